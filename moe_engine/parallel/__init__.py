"""Parallel layouts: process groups, expert/data/pipeline parallelism, ZeRO-1 and FSDP2."""
