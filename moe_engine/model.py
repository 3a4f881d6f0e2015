"""Decoder-only transformer with MoE feed-forward layers."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine import kernels
from moe_engine.config import ModelConfig, Precision
from moe_engine.modules.attention import Attention
from moe_engine.modules.mla import MultiHeadLatentAttention
from moe_engine.modules.mlp import SwiGLU
from moe_engine.modules.norm import RMSNorm
from moe_engine.modules.rope import RotaryEmbedding
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.layer import MoELayer

_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + ffn(norm(h)). With fused kernels
    (``config.fused_kernels``, handed to every module at construction) the residual add
    h = x + attn(...) runs inside the feed-forward norm's fused op. An MoE block's layer reaches its
    experts as ``dispatch`` says (default: all on this device)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dispatch: DispatchSpec | None = None):
        super().__init__()
        fused = self.fused_kernels = config.fused_kernels
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, fused)
        self.attn = Attention(config) if config.mla is None else MultiHeadLatentAttention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, fused)
        self.ffn: MoELayer | SwiGLU
        if config.is_moe_layer(layer_idx):
            self.ffn = MoELayer(config.d_model, config.moe, layer_idx, fused, dispatch)
        else:
            self.ffn = SwiGLU(config.d_model, config.dense_hidden, fused)

    def forward(self, x_BSD: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        if self.fused_kernels:
            h_BSD, normed_BSD = self.ffn_norm(self.attn(self.attn_norm(x_BSD), rope), residual=x_BSD)
            return h_BSD + self.ffn(normed_BSD)
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), rope)
        return h_BSD + self.ffn(self.ffn_norm(h_BSD))


class Transformer(nn.Module):
    """Embedding, blocks, final norm and LM head. With ``tie_embeddings`` there is no ``lm_head``
    module: the logits multiply by the embedding's weight, so the model holds (and a checkpoint
    names) that one matrix once, as ``embed.weight``.

    Every component is chosen here, from ``config`` and ``dispatch``: the fused kernels or the eager
    compositions (``config.fused_kernels``: every RMSNorm, SwiGLU, RoPE, router, the experts and their
    dispatchers, the loss), and where each MoE layer's experts live and how tokens reach them
    (``dispatch``, ``moe_engine.moe.dispatch_spec``; default: all on this device)."""

    def __init__(self, config: ModelConfig, dispatch: DispatchSpec | None = None):
        super().__init__()
        self.config = config
        self.fused_kernels = config.fused_kernels
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        if config.mla is None:
            assert config.head_dim is not None  # ModelConfig resolves it for grouped-query attention
            rope_dim = config.head_dim
        else:
            rope_dim = config.mla.qk_rope_head_dim
        self.rope = RotaryEmbedding(rope_dim, config.seq_len, config.rope_theta, config.fused_kernels)
        self.blocks = nn.ModuleList(Block(config, i, dispatch) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps, config.fused_kernels)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)

    def fused_kernel_paths(self) -> dict[str, kernels.KernelPath]:
        """Where each fused op runs for this model's parameters' device and compute dtype (all on the
        reference path, saying so, while fused kernels are off)."""
        device, dtype = self.embed.weight.device, self.embed.weight.dtype
        paths = kernels.kernel_paths(device, dtype)
        if not self.fused_kernels:
            return {op: kernels.KernelPath(op, "reference", "reference: fused_kernels is off") for op in paths}
        return paths

    def forward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, S, V) in the model's compute dtype. With ``labels_BS`` the mean next-token
        cross-entropy in fp32 instead: with fused kernels from the LM head fused with the loss (the
        logits never exist), else from the logits."""
        h_BSD = self.hidden(tokens_BS)
        if labels_BS is None:
            return self.logits(h_BSD)
        if self.fused_kernels:
            return kernels.linear_cross_entropy(h_BSD, self.head_weight(), labels_BS)
        return _cross_entropy(self.logits(h_BSD), labels_BS)

    def hidden(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, S, D): what the LM head multiplies."""
        h_BSD = self.embed(tokens_BS)
        for block in self.blocks:
            h_BSD = block(h_BSD, self.rope)
        return self.norm(h_BSD)

    def head_weight(self) -> torch.Tensor:
        """The LM head's (V, D) weight: its own, or the embedding's when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h_BSD: torch.Tensor) -> torch.Tensor:
        """The LM head on the final norm's output: its own weight, or the embedding's when tied."""
        if self.lm_head is None:
            return F.linear(h_BSD, self.embed.weight)
        return self.lm_head(h_BSD)

    def loss(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in fp32. Router losses enter the gradient through the MoE layers.
        With fused kernels the LM head and the loss are one op inside ``forward`` (called as the module,
        so its hooks see it); without, the loss follows ``forward`` on the logits."""
        if self.fused_kernels:
            return self(tokens_BS, labels_BS)
        return _cross_entropy(self(tokens_BS), labels_BS)

    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def router_loss(self) -> torch.Tensor:
        """Weighted router losses of the last forward, summed over layers (detached)."""
        losses = [layer.last_router_loss for layer in self.moe_layers() if layer.last_router_loss is not None]
        if not losses:
            return torch.zeros(())
        return torch.stack(losses).sum()

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Norms 1, every matrix N(0, std) in parameter order; an expert-parallel rank's experts get
        the values the single-process model's block of them gets from the same random state."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        experts = {id(p): m for m in self.modules() if isinstance(m, GroupedExperts) for p in (m.gate_up, m.down)}
        for param in self.parameters():
            if param.ndim >= 2:
                if id(param) in experts:
                    experts[id(param)].normal_(param, std)
                else:
                    nn.init.normal_(param, std=std)


def _cross_entropy(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten())


def cast_parameters(model: _ModuleT, precision: Precision) -> _ModuleT:
    """Cast parameters to the precision's dtype, except in modules marked ``keep_fp32``.

    Buffers keep their dtype. A plain ``model.to(dtype)`` also gives a working model: it rounds
    the router's weight as well, and the router still computes its scores in fp32 from it.
    """
    dtype = precision.torch_dtype
    keep = {id(p) for m in model.modules() if getattr(m, "keep_fp32", False) for p in m.parameters()}
    for param in model.parameters():
        if id(param) not in keep:
            param.data = param.data.to(dtype)
    return model


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", seed: int = 0, dispatch: DispatchSpec | None = None
) -> Transformer:
    """Build, initialise (seeded) and cast a model on ``device``, its MoE layers' experts and
    dispatchers as ``dispatch`` says (default: all on this device)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(config, dispatch)
    model.init_weights(config.init_std)
    return cast_parameters(model, config.dtype)
