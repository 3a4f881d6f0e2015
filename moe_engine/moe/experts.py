"""Routed experts: SwiGLU over grouped GEMM, with swappable backends behind one seam.

Weight layout (the (out, in) convention of ``nn.Linear``, also OLMoE's in transformers):

- ``gate_up`` (E, 2F, D): rows [0, F) of expert e are the gate projection, rows [F, 2F) the up
  projection, so ``h = x @ gate_up[e].T`` and ``silu(h[:, :F]) * h[:, F:]``.
- ``down`` (E, D, F): ``y = a @ down[e].T``.

With ``fused_kernels`` (``ModelConfig.fused_kernels``, given at construction) the grouped backends run the activation
and its backward as fused ops (``moe_engine.kernels.swiglu``); the loop backend stays the reference.

Split backward (grouped backends): each call is two autograd nodes, a main node whose backward computes
the input gradient dX and a weight node (``_ExpertWeightGrads``) that computes dW
(``moe_engine.weight_grad_split``): a zero-bubble pipeline schedule's input phase reaches only the
first, its weight phase the second; a plain backward runs both. ``defer_weight_grads()`` defers
dW of the calls made inside it to ``DeferredWeightGrads.run_all()``.

Rows arrive sorted by expert; expert e owns rows [offsets[e-1], offsets[e]). Rows after the last
offset are padding (expert-parallel receive buffers have some): a backend may leave their outputs
undefined, callers mask them. A backend implements ``ExpertBackend.forward``; the module holds the
weights (all experts, or an expert-parallel rank's block of them) and picks the backend from the config.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_engine import kernels
from moe_engine.config import ExpertBackendKind
from moe_engine.moe.expert_backend import (
    ExpertBackend,
    LoopBackend,
    WeightGradOperands,
    split_weights,
    swiglu,
    swiglu_backward,
)
from moe_engine.moe.grouped_gemm import grouped_mm, grouped_mm_path
from moe_engine.moe.permute import ExpertGroups, RowMap
from moe_engine.precision.mxfp8 import gemm as mx
from moe_engine.precision.mxfp8.blocks import MXTensor
from moe_engine.weight_grad_split import input_grad_wanted, split_token_grad, weights_only_reentry


class _GroupedSwiGLU(torch.autograd.Function):
    """Both GEMMs of the experts on ``torch._grouped_mm``; saves x and h, recomputes the activation.

    The main node of the split backward: its backward computes dX and leaves dW's closure in the
    stash for the weight node (``_ExpertWeightGrads``); the weights come in detached."""

    @staticmethod
    def forward(ctx, x_ND, offsets_E, gate_up_EHD, down_EDF, stash, token, fused=False):
        h_NH = grouped_mm(x_ND, gate_up_EHD.transpose(1, 2), offsets_E)
        y_ND = grouped_mm(swiglu(h_NH, fused), down_EDF.transpose(1, 2), offsets_E)
        ctx.save_for_backward(x_ND, h_NH, offsets_E, gate_up_EHD, down_EDF)
        ctx.fused, ctx.stash = fused, stash
        return y_ND

    @staticmethod
    def backward(ctx, grad_y_ND):
        stash = ctx.stash
        token_grad = split_token_grad(ctx, grad_y_ND, 5)
        if weights_only_reentry(ctx, stash):
            return None, None, None, None, None, token_grad, None
        x_ND, h_NH, offsets_E, gate_up_EHD, down_EDF = ctx.saved_tensors
        # A zero-stride gradient (from y.sum()) breaks the grouped GEMM's backward kernels.
        grad_y_ND = grad_y_ND.contiguous()
        grad_a_NF = grouped_mm(grad_y_ND, down_EDF, offsets_E)
        a_NF, grad_h_NH = swiglu_backward(h_NH, grad_a_NF, ctx.fused)
        if stash.wanted:
            stash.compute = lambda: WeightGradOperands(offsets_E, (grad_h_NH, x_ND), (grad_y_ND, a_NF))
        grad_x_ND = grouped_mm(grad_h_NH, gate_up_EHD, offsets_E) if input_grad_wanted(ctx, 0) else None
        return grad_x_ND, None, None, None, None, token_grad, None


class TorchGroupedBackend(ExpertBackend):
    """``torch._grouped_mm`` with device-side offsets.

    No host sync on the CUTLASS path (bf16 on sm9x/sm10x); elsewhere torch's kernel loops over the
    groups on the host (see ``moe_engine.moe.grouped_gemm``). ``path`` names the kernel the last
    forward ran; before any forward, the one bf16 would get on the first visible device.
    """

    def __init__(self, fused_swiglu: bool = False):
        super().__init__(fused_swiglu)
        self.path: str = grouped_mm_path("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16).value

    def forward(self, x_ND, groups, gate_up_EHD, down_EDF):
        self.path = grouped_mm_path(x_ND.device, x_ND.dtype).value
        stash, token = split_weights(x_ND, gate_up_EHD, down_EDF)
        return _GroupedSwiGLU.apply(
            x_ND, groups.offsets_E, gate_up_EHD.detach(), down_EDF.detach(), stash, token, self.fused_swiglu
        )


def _real_rows(x_ND: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """(N, 1) bool: whether each row belongs to an expert (rows after the last offset are padding)."""
    return (torch.arange(x_ND.shape[0], device=x_ND.device) < offsets_E[-1]).unsqueeze(1)


class _MXFP8GroupedSwiGLU(torch.autograd.Function):
    """The experts' SwiGLU with the four fprop/dgrad GEMMs in MXFP8, and the two wgrad GEMMs in MXFP8
    (``mx_wgrad``) or BF16.

    Which GEMM runs in which precision is tabulated in docs/precision.md. Each weight is quantized
    along its reduction axis twice per step: along D / F for fprop, along 2F / D (a fresh
    quantization, not a transposed reuse) for dgrad. The wgrad GEMMs reduce over tokens: each weight's
    two operands (grad_h and x, grad_y and a) are quantized in blocks of 32 rows within each expert's
    rows (``moe_engine.precision.mxfp8.token_blocks``) when its gradient is computed; x, saved blocked
    along D, is quantized a second time.

    Saved for backward, besides the weights and offsets:

    - x in MXFP8, the fprop operand itself (blocks along D), so wgrad of gate_up sees exactly the x
      values the forward GEMM multiplied;
    - h = x @ gate_up^T in MXFP8 (blocks along 2F) instead of BF16; backward recomputes
      a = silu(gate) * up and the SwiGLU derivative from the dequantized h.

    Numerical consequence of saving h in MXFP8: backward sees h rounded to E4M3 (relative error up
    to 2^-4 per element, against 2^-8 for BF16), so the recomputed a that feeds wgrad of ``down``
    and the SwiGLU derivative that forms grad_h differ from the forward's by that much. The
    gradients are those of a slightly different function than the forward computed; the error is of
    the same order as the one the MXFP8 GEMMs already introduce.

    Padding rows (after the last offset) may hold anything, NaN included: they are zeroed before
    every quantization, so no NaN scale arises, and their outputs and input gradients are zero.

    Given the token rows and their ``RowMap`` instead of gathered rows, the gather, that zeroing and
    x's quantization are one op (``kernels.gather_rows_mx``), and x's gradient goes back to the token
    rows through the gather's backward: the same bytes and gradients, without the bf16 copy of the rows.
    """

    @staticmethod
    def forward(
        ctx,
        x,
        offsets_E,
        gate_up_EHD,
        down_EDF,
        stash,
        token,
        path,
        fused=False,
        rows: RowMap | None = None,
        mx_wgrad=False,
    ):
        if rows is None:  # x: the (N, D) rows in expert order
            x_mx = mx.quantize_rows(torch.where(_real_rows(x, offsets_E), x, 0))
        else:  # x: the (T, D) token rows, gathered and quantized in one op
            codes, scales = kernels.gather_rows_mx(x, rows.assignment_R, rows.top_k, rows.filled_R, offsets_E[-1:])
            x_mx = MXTensor(codes, scales, axis=-1)
        h_NH = mx.grouped_mm(x_mx, mx.quantize_weight(gate_up_EHD), offsets_E, x.dtype, path)
        a_mx = mx.quantize_rows(swiglu(h_NH, fused))
        y_ND = mx.grouped_mm(a_mx, mx.quantize_weight(down_EDF), offsets_E, x.dtype, path)

        if any(ctx.needs_input_grad):
            h_mx = mx.quantize_rows(h_NH)
            ctx.save_for_backward(x_mx.data, x_mx.scales, h_mx.data, h_mx.scales, offsets_E, gate_up_EHD, down_EDF)
            ctx.path, ctx.fused, ctx.rows, ctx.stash, ctx.mx_wgrad = path, fused, rows, stash, mx_wgrad
        return y_ND

    @staticmethod
    def backward(ctx, grad_y_ND):
        stash = ctx.stash
        token_grad = split_token_grad(ctx, grad_y_ND, 5)
        if weights_only_reentry(ctx, stash):
            return None, None, None, None, None, token_grad, None, None, None, None
        x_data, x_scales, h_data, h_scales, offsets_E, gate_up_EHD, down_EDF = ctx.saved_tensors
        _, hidden2, d_model = gate_up_EHD.shape
        dtype, path = grad_y_ND.dtype, ctx.path
        # Contiguous: a zero-stride gradient (from y.sum()) breaks the grouped GEMM's kernels.
        grad_y_ND = torch.where(_real_rows(grad_y_ND, offsets_E), grad_y_ND, 0).contiguous()

        down_dgrad = mx.quantize_weight(down_EDF, transposed=True)
        grad_a_NF = mx.grouped_mm(mx.quantize_rows(grad_y_ND), down_dgrad, offsets_E, dtype, path)
        h_NH = mx.dequantize_rows(MXTensor(h_data, h_scales, axis=-1), hidden2, dtype)
        a_NF, grad_h_NH = swiglu_backward(h_NH, grad_a_NF, ctx.fused)

        if stash.wanted:
            mx_wgrad = ctx.mx_wgrad

            def weight_grads():
                x_ND = mx.dequantize_rows(MXTensor(x_data, x_scales, axis=-1), d_model, dtype)
                return WeightGradOperands(offsets_E, (grad_h_NH, x_ND), (grad_y_ND, a_NF), mxfp8=mx_wgrad)

            stash.compute = weight_grads
        grad_x_ND = None
        if input_grad_wanted(ctx, 0):
            gate_up_dgrad = mx.quantize_weight(gate_up_EHD, transposed=True)
            grad_x_ND = mx.grouped_mm(mx.quantize_rows(grad_h_NH), gate_up_dgrad, offsets_E, dtype, path)
            if ctx.rows is not None:  # back to the token rows: each token's kept rows summed
                rows = ctx.rows
                grad_x_ND = kernels.gather_rows_backward(grad_x_ND, rows.row_N, rows.top_k, rows.kept_N)
        return grad_x_ND, None, None, None, None, token_grad, None, None, None, None


class MXFP8Backend(ExpertBackend):
    """MXFP8 grouped GEMMs (``moe_engine.precision.mxfp8.gemm``, and ``wgrad`` for the weight gradients)
    with device-side offsets; no host sync where the weight-gradient GEMMs run the Triton kernel (MXFP8,
    capability 8.9 on) or take the CUTLASS path (bf16, ``moe_engine.moe.grouped_gemm``).

    ``path`` names the implementation the last forward ran, read after it (``mx.path_label``: torch's
    ``scaled_grouped_mm`` on capability 10.x, or its fallback where a call's operands were not the
    op's; Triton's ``dot_scaled`` on other CUDA devices from 8.9, native or emulated as compiled;
    "torch-emulation" elsewhere); before any forward, the one the first CUDA device would get if present.
    """

    def __init__(self, fused_swiglu: bool = False, mx_wgrad: bool = True):
        super().__init__(fused_swiglu)
        self.mx_wgrad = mx_wgrad
        """The weight-gradient GEMMs in MXFP8 (``MoEConfig.mxfp8_wgrad``); False: in BF16."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.path: str = mx.path_label(mx.available_path(device), device)

    def forward(self, x_ND, groups, gate_up_EHD, down_EDF):
        return self._run(x_ND, groups, gate_up_EHD, down_EDF, None)

    def forward_gathered(self, x_TD, rows, groups, gate_up_EHD, down_EDF):
        """With fused kernels, the gather and x's quantization are one op (``kernels.gather_rows_mx``)."""
        if not self.fused_swiglu:
            return super().forward_gathered(x_TD, rows, groups, gate_up_EHD, down_EDF)
        return self._run(x_TD, groups, gate_up_EHD, down_EDF, rows)

    def _run(self, x, groups, gate_up_EHD, down_EDF, rows: RowMap | None):
        path = mx.available_path(x.device)
        stash, token = split_weights(x, gate_up_EHD, down_EDF)
        y_ND = _MXFP8GroupedSwiGLU.apply(
            x,
            groups.offsets_E,
            gate_up_EHD.detach(),
            down_EDF.detach(),
            stash,
            token,
            path,
            self.fused_swiglu,
            rows,
            self.mx_wgrad,
        )
        # Read after the call: torch's op may fall back per call, and Triton's IR exists once compiled.
        self.path = mx.path_label(path, x.device)
        return y_ND


BACKENDS: dict[ExpertBackendKind, type[ExpertBackend]] = {
    ExpertBackendKind.LOOP: LoopBackend,
    ExpertBackendKind.TORCH: TorchGroupedBackend,
    ExpertBackendKind.MXFP8: MXFP8Backend,
}


def backend_class(kind: ExpertBackendKind) -> type[ExpertBackend]:
    """The backend class of ``kind``."""
    if kind is ExpertBackendKind.FP8:
        # Imported here: the FP8 backend builds on this module's split backward, so a module-level
        # import either way would be a circle.
        from moe_engine.precision.fp8_experts import FP8Backend

        return FP8Backend
    return BACKENDS[kind]


class GroupedExperts(nn.Module):
    """SwiGLU experts of hidden size F, stored as two stacked weight tensors: all ``num_experts`` of
    them, or the contiguous block ``held`` (global indices) an expert-parallel rank holds.
    ``mxfp8_wgrad``: with the mxfp8 backend, its weight-gradient GEMMs in MXFP8 (``MoEConfig.mxfp8_wgrad``)."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        num_experts: int,
        backend: ExpertBackendKind,
        fused_kernels: bool = False,
        held: range | None = None,
        mxfp8_wgrad: bool = True,
    ):
        super().__init__()
        held = range(num_experts) if held is None else held
        if held.step != 1 or not 0 <= held.start < held.stop <= num_experts:
            raise ValueError(f"held experts {held} are not a contiguous block of range({num_experts})")
        self.gate_up = nn.Parameter(torch.empty(len(held), 2 * hidden, d_model))
        self.down = nn.Parameter(torch.empty(len(held), d_model, hidden))
        backend_type = backend_class(ExpertBackendKind(backend))
        if backend_type is MXFP8Backend:
            self.backend: ExpertBackend = MXFP8Backend(fused_kernels, mxfp8_wgrad)
        else:
            self.backend = backend_type(fused_kernels)
        # Global indices of the experts held here (all of them without expert parallelism).
        self.global_experts = held
        self.total_experts = num_experts

    @property
    def fused_kernels(self) -> bool:
        """Whether the backend runs the activation as the fused op (``ExpertBackend.fused_swiglu``)."""
        return self.backend.fused_swiglu

    @fused_kernels.setter
    def fused_kernels(self, on: bool) -> None:
        self.backend.fused_swiglu = on

    @torch.no_grad()
    def normal_(self, param: nn.Parameter, std: float) -> None:
        """Fill ``gate_up`` or ``down`` with N(0, std) as if all the experts were held: the whole
        (E, ...) tensor is drawn and the held block kept, so a rank's experts get the values the
        single-process model's have from the same random state."""
        if self.num_experts == self.total_experts:
            param.normal_(std=std)
            return
        whole = torch.empty(self.total_experts, *param.shape[1:], dtype=param.dtype, device=param.device)
        param.copy_(whole.normal_(std=std)[self.global_experts.start : self.global_experts.stop])

    @property
    def num_experts(self) -> int:
        """Experts held here (the local experts under expert parallelism)."""
        return self.gate_up.shape[0]

    def forward(self, x: torch.Tensor, groups: ExpertGroups, rows: RowMap | None = None) -> torch.Tensor:
        """(N, D) outputs of the (N, D) rows ``x`` in expert order; with ``rows``, of the rows
        ``gather_tokens(x, rows)`` places in expert order from the (T, D) token rows ``x``, which the
        backend may gather itself (the MXFP8 one does, straight into its quantized operand)."""
        if rows is None:
            return self.backend.forward(x, groups, self.gate_up, self.down)
        return self.backend.forward_gathered(x, rows, groups, self.gate_up, self.down)
