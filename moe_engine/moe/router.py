"""Top-k token-choice router and the benchmark routing modes.

Scores are computed in fp32 from a bias-free linear map D -> E. The selected experts come from the
scores (``learned``) or from a benchmark mode (``random``, ``balanced``, ``skewed``); in every mode
the weights of the selected experts are gathered from the real scores, so the router's compute and
its gradients are the same as in training.

Group-limited routing (``MoEConfig.n_groups``, ``top_groups``; DeepSeek-V3) applies to learned
routing: the E experts form n_groups contiguous groups, each group is scored by the sum of its two
highest selection scores (scores plus the expert bias; its one score when a group has one expert),
the top_groups groups of each token are kept and its top-k experts chosen among theirs. The combine
weights are the chosen experts' scores, renormalised when ``normalize_top_k`` asks, times
``routed_scaling_factor``.

With ``Router.fused_kernels`` (a constructor argument), everything after the logits' GEMM but the expert selection (the
scores, the gathered and renormalised weights, the per-expert mean probability of the balance loss and
each token's logsumexp for the z-loss) runs as one fused op each way (``moe_engine.kernels.router``),
which keeps only the logits for backward; the selection is the same code on the same scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine import kernels
from moe_engine.config import MoEConfig, RoutingMode, ScoreFunc

# Offsets the per-layer generator seeds so that layers route independently.
_LAYER_SEED_STRIDE = 1_000_003


@dataclass
class RouterOutput:
    expert_TK: torch.Tensor
    """int64 expert index of each of a token's k assignments."""
    weight_TK: torch.Tensor
    """fp32 combine weight of each assignment (differentiable w.r.t. the router weight)."""
    counts_E: torch.Tensor
    """int64 number of assignments each expert received."""
    aux_loss: torch.Tensor
    """Unweighted load-balancing loss (fp32 scalar)."""
    z_loss: torch.Tensor
    """Unweighted router z-loss (fp32 scalar)."""
    loss: torch.Tensor
    """aux_loss_weight * aux_loss + z_loss_weight * z_loss."""


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-style balance loss E * sum_e f_e * P_e.

    f_e = counts_e / (T * k) is the fraction of assignments expert e received and P_e the mean
    over tokens of its normalised score; the loss is 1 under perfect balance.
    """
    num_tokens, num_experts = probs_TE.shape
    fraction_E = counts_E.to(probs_TE.dtype) / (num_tokens * top_k)
    return num_experts * torch.dot(fraction_E, probs_TE.mean(dim=0))


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss: mean over tokens of logsumexp(logits)^2 (keeps logits small)."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


def expert_counts(expert_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, computed on the device (bincount would sync on CUDA)."""
    flat = expert_TK.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def limit_to_top_groups(choice_TE: torch.Tensor, n_groups: int, top_groups: int) -> torch.Tensor:
    """``choice_TE`` with every expert outside each token's ``top_groups`` best groups set to -inf.

    A group's score is the sum of its two highest choice scores (DeepSeek-V3); chosen on the device.
    """
    num_tokens, num_experts = choice_TE.shape
    per_group = num_experts // n_groups
    grouped_TGe = choice_TE.view(num_tokens, n_groups, per_group)
    group_score_TG = grouped_TGe.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
    chosen_TG = group_score_TG.topk(top_groups, dim=-1).indices
    keep_TG = torch.zeros(num_tokens, n_groups, dtype=torch.bool, device=choice_TE.device).scatter_(1, chosen_TG, True)
    keep_TE = keep_TG.unsqueeze(-1).expand(num_tokens, n_groups, per_group).reshape(num_tokens, num_experts)
    return choice_TE.masked_fill(~keep_TE, float("-inf"))


def zipf_log_probs(num_experts: int, exponent: float, device=None) -> torch.Tensor:
    """log p_e for p_e proportional to 1 / (e + 1)^exponent."""
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float32, device=device)
    return torch.log_softmax(-exponent * torch.log(ranks), dim=0)


class Router(nn.Module):
    """Linear scores D -> E in fp32, expert selection, combine weights and auxiliary losses.

    The scores are computed in fp32 whatever the dtype of the input and of the parameter: the
    weight is upcast in forward, so a router cast with ``nn.Module.to(dtype)`` still computes in
    fp32 (from the rounded weight) and its gradient flows back to the parameter in its own dtype.
    """

    # ``cast_parameters`` leaves the router's parameters in fp32 whatever the model's precision.
    keep_fp32 = True
    expert_bias: torch.Tensor

    def __init__(self, d_model: int, config: MoEConfig, layer_idx: int = 0, fused_kernels: bool = False):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, d_model, dtype=torch.float32))
        # Shifts selection only (aux-loss-free balancing); never enters the combine weights.
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self.layer_idx = layer_idx
        self._seed = config.routing_seed + _LAYER_SEED_STRIDE * layer_idx
        self._generator: torch.Generator | None = None
        self.fused_kernels = fused_kernels

    def reset_routing_generator(self) -> None:
        """Restart the random/skewed routing stream from its seed."""
        self._generator = None

    def routing_state(self) -> tuple[torch.device, torch.Tensor] | None:
        """Where the random/skewed routing stream stands (None: not started, it starts from the seed)."""
        if self._generator is None:
            return None
        return self._generator.device, self._generator.get_state()

    def set_routing_state(self, state: tuple[torch.device, torch.Tensor] | None) -> None:
        """Put the routing stream back where ``routing_state`` saw it."""
        if state is None:
            self._generator = None
            return
        device, generator_state = state
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        self._generator.set_state(generator_state)

    def _routing_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self._seed)
        return self._generator

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        cfg = self.config
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        if self.fused_kernels:
            return self._fused_forward(logits_TE)
        if cfg.score_func is ScoreFunc.SOFTMAX:
            scores_TE = torch.softmax(logits_TE, dim=-1)
            probs_TE = scores_TE
        else:
            scores_TE = torch.sigmoid(logits_TE)
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)

        expert_TK = self.select_experts(scores_TE.detach())
        weight_TK = scores_TE.gather(1, expert_TK)
        if cfg.normalize_top_k:
            weight_TK = weight_TK / weight_TK.sum(dim=-1, keepdim=True)
        if cfg.routed_scaling_factor != 1.0:
            weight_TK = weight_TK * cfg.routed_scaling_factor

        counts_E = expert_counts(expert_TK, cfg.num_experts)
        aux = load_balancing_loss(probs_TE, counts_E, cfg.top_k)
        zl = z_loss(logits_TE)
        loss = cfg.aux_loss_weight * aux + cfg.z_loss_weight * zl
        return RouterOutput(expert_TK, weight_TK, counts_E, aux, zl, loss)

    def _fused_forward(self, logits_TE: torch.Tensor) -> RouterOutput:
        cfg = self.config
        sigmoid = cfg.score_func is ScoreFunc.SIGMOID
        if cfg.routing is RoutingMode.LEARNED:
            # The same op on the same logits as the eager path, so the same experts; nothing saved.
            with torch.no_grad():
                scores_TE = torch.sigmoid(logits_TE) if sigmoid else torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = logits_TE.detach()  # the other modes read only its shape and device
        expert_TK = self.select_experts(scores_TE)
        weight_TK, mean_probs_E, lse_T = kernels.router_scores(
            logits_TE, expert_TK, sigmoid, cfg.normalize_top_k, cfg.routed_scaling_factor
        )
        counts_E = expert_counts(expert_TK, cfg.num_experts)
        fraction_E = counts_E.to(torch.float32) / (logits_TE.shape[0] * cfg.top_k)
        aux = cfg.num_experts * torch.dot(fraction_E, mean_probs_E)
        zl = lse_T.square().mean()
        loss = cfg.aux_loss_weight * aux + cfg.z_loss_weight * zl
        return RouterOutput(expert_TK, weight_TK, counts_E, aux, zl, loss)

    def select_experts(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """int64 (T, k) expert indices, distinct within a token, chosen on the device."""
        cfg = self.config
        num_tokens, num_experts = scores_TE.shape
        device = scores_TE.device
        if cfg.routing is RoutingMode.LEARNED:
            choice_TE = scores_TE + self.expert_bias
            if cfg.group_limited:
                choice_TE = limit_to_top_groups(choice_TE, cfg.n_groups, cfg.groups_per_token)
            return torch.topk(choice_TE, cfg.top_k, dim=-1).indices
        if cfg.routing is RoutingMode.BALANCED:
            slot_TK = torch.arange(num_tokens * cfg.top_k, device=device).view(num_tokens, cfg.top_k)
            return slot_TK % num_experts
        generator = self._routing_generator(device)
        noise_TE = torch.rand(num_tokens, num_experts, device=device, generator=generator)
        if cfg.routing is RoutingMode.RANDOM:
            # The top-k of i.i.d. uniforms is a uniformly random k-subset.
            return torch.topk(noise_TE, cfg.top_k, dim=-1).indices
        # Gumbel-top-k samples k experts without replacement, the first with probability p_e.
        gumbel_TE = -torch.log(-torch.log(noise_TE.clamp_(min=1e-20)))
        log_p_E = zipf_log_probs(num_experts, cfg.zipf_exponent, device)
        return torch.topk(log_p_E + gumbel_TE, cfg.top_k, dim=-1).indices

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor) -> None:
        """DeepSeek-V3 rule: raise the bias of under-loaded experts, lower it for over-loaded ones."""
        if self.config.expert_bias_rate == 0:
            return
        load_E = counts_E.float()
        self.expert_bias += self.config.expert_bias_rate * torch.sign(load_E.mean() - load_E)
