"""Mixture-of-experts layer: router, routing metadata and permutations, grouped experts."""

from moe_engine.moe.layer import MoELayer

__all__ = ["MoELayer"]
