"""MXFP8: the block-scaled format (``blocks``), its Triton quantize kernels (``kernels``), the grouped GEMM
(``gemm``) and torch's scaled grouped GEMM on Blackwell (``scaled_mm``); docs/precision.md."""
