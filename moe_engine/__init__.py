"""moe-engine: a Mixture-of-Experts training engine."""

from importlib.metadata import PackageNotFoundError, version

from moe_engine.config import ExpertBackendKind, MLAConfig, ModelConfig, MoEConfig, Precision, RoutingMode, ScoreFunc

try:
    __version__ = version("moe-engine")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"


def __getattr__(name: str):
    # The model is imported on first use, so that arithmetic on configurations (plan, FLOPs) never
    # loads torch or the modules that run a model.
    if name in ("Transformer", "build_model"):
        from moe_engine import model

        return getattr(model, name)
    raise AttributeError(f"module 'moe_engine' has no attribute {name!r}")


__all__ = [
    "ExpertBackendKind",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "Precision",
    "RoutingMode",
    "ScoreFunc",
    "Transformer",
    "__version__",
    "build_model",
]
