"""Mixture-of-experts layer: router, routing metadata and permutations, dispatch, grouped experts."""

from moe_engine.moe.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.layer import MoELayer

__all__ = ["AllToAllDispatcher", "DispatchSpec", "Dispatcher", "LocalDispatcher", "MoELayer"]
