"""MXFP8: the block-scaled format (``blocks``), its Triton quantize kernels (``kernels``), the grouped GEMM
(``gemm``), torch's scaled grouped GEMM on Blackwell (``scaled_mm``), and the weight gradients' operands
blocked along tokens (``token_blocks``) with their GEMM (``wgrad``); docs/precision.md."""
