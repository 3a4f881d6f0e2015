"""The cases of ``mxfp8.scaled_mm``'s two Triton kernels, the tail zeroing (``zero_rows_after``) and the
A-scale layout (``blocked_group_scales``): shared by the tests on the run's device
(tests/unit/moe_engine/precision/mxfp8/test_scaled_mm.py) and the interpreted runs
(tests/integration/toolchains/test_mxfp8_scaled_mm_interpreted.py)."""

ZERO_CASES = [
    # rows, columns, end of the last expert's rows, dtype
    (200, 300, 130, "bfloat16"),  # a tail starting inside a program's rows, columns over two programs
    (64, 48, 64, "bfloat16"),  # no tail
    (70, 16, 0, "bfloat16"),  # no expert rows: all zeroed
    (129, 8, 127, "float32"),
]

BLOCKED_CASES = [
    # counts per expert, padding rows, scale columns (K / 32), scales a transposed view
    ((5, 0, 17, 9, 0), 6, 2, False),
    ((130, 1, 0, 300), 3, 9, False),  # groups over one tile, columns not a multiple of 4
    ((0, 0, 0), 4, 3, False),  # no expert rows: zero tiles only
    ((40, 90), 0, 130, True),  # columns over several chunks, strided scales
]
