"""Micro-benchmarks (``pytest bench/micro``): see ``bench/micro/conftest.py``."""

FUSED_OPS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "router_scores", "linear_cross_entropy", "gather_rows_mx")
"""The fused ops ``test_fused_ops.py`` times against their eager compositions, one ratio each."""
