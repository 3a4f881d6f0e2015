"""The op kinds of ``moe-bench project --breakdown`` (``OP_KINDS``): which kind a priced op counts as
(``op_kind_of``), from its priced kind, else its ATen name in the tables below, else torch's own tags.

The priced kind first (GEMMs, grouped GEMMs including the MX ones, attention kernels, collectives, free
views), then the memory-bound ops by their ATen name; an op of another namespace (a custom op: the
engine's fused kernels) is ``fused``.
"""

from __future__ import annotations

from functools import cache

from bench.predict.pricing import PricedOp

__all__ = ["OP_KINDS", "op_kind_of"]

OP_KINDS = {
    "gemm": "dense matrix products (mm, addmm, bmm)",
    "grouped_gemm": "expert grouped GEMMs (bf16 and MXFP8)",
    "attention": "fused attention kernels, forward and backward",
    "elementwise": "pointwise arithmetic, activations and their gradients, comparisons, masks",
    "reduction": "sums, means, norms, softmax and log-softmax, losses, scans",
    "copy_cast": "copies, dtype casts, clones, concatenations, MXFP8 quantization",
    "fill": "zeros, constants, ranges",
    "index_sort": "gathers, scatters, indexing, embedding lookups, sorts, top-k, searches",
    "random": "random number generation",
    "fused": "the engine's own fused ops (custom ops outside ATen)",
    "collective": "collectives and stage messages (priced on the network)",
    "free": "views and metadata (no kernel; time only on a CPU profile)",
    "other": "an ATen op none of the above names (add it to bench/predict/op_kinds.py)",
}
"""The op kinds of the breakdown, in table order, with what each holds."""

_ELEMENTWISE = {
    "add",
    "sub",
    "rsub",
    "mul",
    "div",
    "neg",
    "exp",
    "exp2",
    "log",
    "log2",
    "log10",
    "log1p",
    "expm1",
    "sqrt",
    "rsqrt",
    "pow",
    "silu",
    "silu_backward",
    "sigmoid",
    "sigmoid_backward",
    "tanh",
    "tanh_backward",
    "relu",
    "threshold_backward",
    "gelu",
    "gelu_backward",
    "where",
    "masked_fill",
    "clamp",
    "clamp_min",
    "clamp_max",
    "lerp",
    "addcmul",
    "addcdiv",
    "maximum",
    "minimum",
    "abs",
    "sign",
    "sgn",
    "reciprocal",
    "square",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_not",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_not",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "remainder",
    "fmod",
    "floor_divide",
    "floor",
    "ceil",
    "round",
    "trunc",
    "sin",
    "cos",
    "erf",
    "nan_to_num",
    "isnan",
    "isinf",
    "softplus",
    "hardtanh",
    "tril",
    "triu",
}
_REDUCTION = {
    "sum",
    "mean",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "norm",
    "linalg_vector_norm",
    "prod",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "cumsum",
    "cumprod",
    "logsumexp",
    "softmax",
    "_softmax",
    "log_softmax",
    "_log_softmax",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
    "nll_loss_forward",
    "nll_loss_backward",
    "nll_loss",
    "dot",
    "vdot",
    "all",
    "any",
    "count_nonzero",
    "native_layer_norm",
    "native_layer_norm_backward",
    "_fused_rms_norm",
    "_fused_rms_norm_backward",
    "mse_loss",
}
_COPY_CAST = {
    "_to_copy",
    "copy",
    "clone",
    "contiguous",
    "cat",
    "stack",
    "_copy_from",
    "_copy_from_and_resize",
    "lift_fresh_copy",
    "slice_backward",
    "select_backward",
    "repeat",
    "roll",
    "flip",
    "constant_pad_nd",
    "expand_copy",
    "view_copy",
    "_unsafe_index_put",
}
_FILL = {
    "zeros",
    "zeros_like",
    "new_zeros",
    "ones",
    "ones_like",
    "new_ones",
    "full",
    "full_like",
    "new_full",
    "fill",
    "zero",
    "arange",
    "scalar_tensor",
    "linspace",
    "eye",
}
_INDEX_SORT = {
    "index_select",
    "index",
    "index_put",
    "_index_put_impl",
    "index_add",
    "index_copy",
    "index_fill",
    "gather",
    "scatter",
    "scatter_add",
    "scatter_reduce",
    "embedding",
    "embedding_dense_backward",
    "embedding_backward",
    "masked_select",
    "masked_scatter",
    "nonzero",
    "searchsorted",
    "bucketize",
    "repeat_interleave",
    "take",
    "sort",
    "argsort",
    "topk",
    "kthvalue",
    "bincount",
    "histc",
    "unique",
    "_unique2",
}
_RANDOM = {
    "normal",
    "uniform",
    "rand",
    "randn",
    "randint",
    "random",
    "bernoulli",
    "randperm",
    "exponential",
    "multinomial",
    "rand_like",
    "randn_like",
    "randint_like",
    "native_dropout",
}
_BY_NAME = {
    **dict.fromkeys(_ELEMENTWISE, "elementwise"),
    **dict.fromkeys(_REDUCTION, "reduction"),
    **dict.fromkeys(_COPY_CAST, "copy_cast"),
    **dict.fromkeys(_FILL, "fill"),
    **dict.fromkeys(_INDEX_SORT, "index_sort"),
    **dict.fromkeys(_RANDOM, "random"),
}
# max and min reduce, except their two-tensor overloads.
_OVERLOADS = {
    "aten.max.other": "elementwise",
    "aten.min.other": "elementwise",
    "aten.max.default": "reduction",
    "aten.min.default": "reduction",
    "aten.max.dim": "reduction",
    "aten.min.dim": "reduction",
}
_PRICED = {
    "gemm": "gemm",
    "grouped_gemm": "grouped_gemm",
    "mx_gemm": "grouped_gemm",
    "attention": "attention",
    "collective": "collective",
    "free": "free",
    "fused": "fused",
}


def op_kind_of(priced: PricedOp) -> str:
    """The breakdown's kind of a priced op (``OP_KINDS``): its priced kind, or for a memory-bound op
    its ATen name; an MXFP8 quantization region is ``copy_cast``."""
    kind = _PRICED.get(priced.work.kind)
    if kind is not None:
        return kind
    if priced.op.region is not None:
        return "copy_cast"
    if not priced.op.name.startswith("aten."):
        return "fused"
    return _memory_kind(priced.op.name)


@cache
def _memory_kind(name: str) -> str:
    packet = name.rsplit(".", 1)[0] if name.count(".") >= 2 else name
    if name in _OVERLOADS:
        return _OVERLOADS[name]
    if packet.rsplit(".", 1)[-1] in ("max", "min"):
        return "reduction"
    base = packet.partition(".")[2].removeprefix("_foreach_")
    if base.endswith("_") and not base.endswith("__"):
        base = base[:-1]
    return _BY_NAME.get(base) or _tagged_kind(name)


def _tagged_kind(name: str) -> str:
    """A name the tables miss: torch's own pointwise and reduction tags, else ``other``."""
    import torch  # heavy: only for names the tables miss; the arithmetic runs without it

    namespace, packet, overload = (name.split(".") + ["default"])[:3]
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError):
        return "other"
    if torch.Tag.pointwise in op.tags:
        return "elementwise"
    if torch.Tag.reduction in op.tags:
        return "reduction"
    return "other"
