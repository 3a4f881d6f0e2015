"""Low-precision formats: OCP microscaling (MXFP8)."""
