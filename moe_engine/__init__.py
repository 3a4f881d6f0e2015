"""moe-engine: a Mixture-of-Experts training engine."""

from importlib.metadata import PackageNotFoundError, version

from moe_engine.config import ExpertBackendKind, ModelConfig, MoEConfig, Precision, RoutingMode, ScoreFunc
from moe_engine.model import Transformer, build_model

try:
    __version__ = version("moe-engine")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ExpertBackendKind",
    "ModelConfig",
    "MoEConfig",
    "Precision",
    "RoutingMode",
    "ScoreFunc",
    "Transformer",
    "build_model",
    "__version__",
]
