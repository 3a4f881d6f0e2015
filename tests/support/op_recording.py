"""What a region runs: the ops it dispatches (``OpRecorder``, ``model_step_ops``) and the tensors autograd
saves for backward (``saved_while``)."""

from collections import Counter

import torch
from fused_cases import model_batch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine import ModelConfig, build_model


class OpRecorder(TorchDispatchMode):
    """Every op dispatched inside, by schema name (``aten::mm``, ``moe_engine::rms_norm``)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim":
            self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    def fused(self) -> dict[str, int]:
        return {name: n for name, n in self.ops.items() if name.startswith("moe_engine::")}


def model_step_ops(config: ModelConfig) -> OpRecorder:
    """The ops of one fake-tensor training step (forward and backward) of a model built from ``config``."""
    tokens, labels = model_batch()
    with FakeTensorMode() as mode:
        model = build_model(config)
        with OpRecorder() as recorder:
            model.loss(mode.from_tensor(tokens), mode.from_tensor(labels)).backward()
    return recorder


def saved_while(fn) -> list[torch.Tensor]:
    """Every tensor autograd saves for backward while ``fn()`` runs, in the order saved."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved
