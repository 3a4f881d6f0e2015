"""Tolerances from floating-point error analysis, for tests that compare two computations of one function.

The engine and a plain reference (or compiled and eager code, or one process and several) compute
the same values but round differently: their sums run in other orders, and on another machine another
BLAS blocks them otherwise. A sum of k terms rounded with unit roundoff u is off by at most
gamma_k * sum|terms|, gamma_k = k u / (1 - k u), in any order (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., section 3.1), but that worst case needs every rounding to err the same
way. The tests' inputs are random, of both signs: the partial sums of k terms of size s grow like
sqrt(i) s, each rounding adds an independent error of up to u times a partial sum, and the result,
about sqrt(k) s in size, is off by about sqrt(k) u relative to it (Higham and Mary, SIAM J. Sci.
Comput. 41(5), 2019, make this a bound that holds with high probability). The errors of the successive
reductions of a chain (a layer's GEMMs, its softmax, and their backward) are independent too and add
in quadrature, and a well-conditioned layer passes an earlier relative error on about unchanged. For
a chain of `depth` reductions of up to k terms, each result also rounded once to the dtype it is
stored in, the difference of two implementations, relative to the largest |reference| value, is then
about sqrt(2 depth) (sqrt(k) u_accumulate + u_storage), and the largest of up to a million such
normally distributed differences about 5 times that. So:

    tolerance = 10 * sqrt(depth) * (sqrt(k) * u_accumulate + u_storage)

k is the longest reduction in the chain (a matmul's inner size, the tokens a weight gradient sums
over), depth the number of reductions one after the other from the inputs to the compared value (for
a gradient: through the forward pass and back). The differences these tests measure sit 10 to 100
times below this; a wrong scale of 1 + 1e-3, a missing term or a swapped operand moves results by
1e-3 or more of their size and fails.
"""

from __future__ import annotations

import math

import torch

MARGIN = 10.0
"""Five standard deviations for the largest of many differences, times sqrt(2) for two sides, rounded up."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next representable value: fp32 2^-24, bf16 2^-8."""
    return torch.finfo(dtype).eps / 2


def tolerance(dtype: torch.dtype, k: int, depth: int = 1, accumulate: torch.dtype = torch.float32) -> float:
    """MARGIN * sqrt(depth) * (sqrt(k) * u(accumulate) + u(dtype)), relative to the largest |reference|
    value (see the module docstring). ``dtype``: what the compared values are stored in;
    ``accumulate``: what their sums run in (fp32 for bf16 GEMMs too, fp64 for fp64)."""
    if dtype == torch.float64:
        accumulate = torch.float64
    return MARGIN * math.sqrt(depth) * (math.sqrt(k) * unit_roundoff(accumulate) + unit_roundoff(dtype))


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, tol: float, msg: str | None = None) -> None:
    """Every value within ``tol`` times the largest |expected| value: an absolute tolerance scaled to
    the tensor and no relative one, for an entry near zero carries the rounding of the large terms
    that summed to it."""
    expected = expected.to(actual.device)
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=tol * scale, msg=None if msg is None else lambda m: f"{msg}: {m}"
    )


def moe_layer_tolerance(tokens: int, d_model: int, hidden: int, gradients: bool = True) -> float:
    """``tolerance`` of an fp32 MoE layer's output, or with ``gradients`` of its input's and parameters'
    gradients: the router's logits and softmax, the experts' two GEMMs, the combine (five reductions
    over up to d_model or hidden terms); gradients run the chain back and sum the weights' over the
    tokens."""
    if not gradients:
        return tolerance(torch.float32, max(d_model, hidden), depth=5)
    return tolerance(torch.float32, max(d_model, hidden, tokens), depth=11)


def model_tolerance(config, tokens: int, gradients: bool = True) -> float:
    """``tolerance`` of an fp32 model's loss, or with ``gradients`` of its parameters' gradients.

    A block is about twelve reductions one after the other (two norms; the attention's projections,
    scores, softmax, values and output projection; the router's logits and softmax; the feed-forward's
    two GEMMs; the combine), the head four more (norm, LM head, cross-entropy's logsumexp, the mean
    over the ``tokens``). Gradients run the chain back and sum each weight's over the tokens. k is the
    longest of these sums: the widest layer, the vocabulary or the tokens.
    """
    widths = [
        config.d_model,
        config.vocab_size,
        tokens,
        config.dense_hidden,
        config.moe.expert_hidden,
        config.moe.shared_expert_hidden,
        config.moe.num_experts,
    ]
    if config.mla is None:
        widths.append(config.n_heads * config.head_dim)
    else:
        widths += [config.n_heads * config.mla.qk_head_dim, config.n_heads * config.mla.v_head_dim]
    depth = 12 * config.n_layers + 4
    if gradients:
        depth = 2 * depth + 1
    return tolerance(torch.float32, max(widths), depth)


def in_quadrature(*tolerances: float) -> float:
    """The tolerance of a result that carries several independent roundings (they add in quadrature)."""
    return math.sqrt(sum(t * t for t in tolerances))


def assert_moves_close(
    moved: torch.Tensor, want_moved: torch.Tensor, tol: float, params: torch.Tensor, steps: int, msg: str | None = None
) -> None:
    """What ``steps`` optimizer steps moved fp32 parameters (now about ``params``): within ``tol`` of the
    largest move, plus the parameters' own rounding, for each step rounds each parameter to fp32 (up
    to u |p| on each side, however small the move)."""
    want_moved = want_moved.to(moved.device)
    rounding = 2 * steps * unit_roundoff(torch.float32) * params.detach().abs().max().item()
    atol = tol * want_moved.detach().abs().max().item() + rounding
    torch.testing.assert_close(
        moved, want_moved, rtol=0, atol=atol, msg=None if msg is None else lambda m: f"{msg}: {m}"
    )
