"""The trainer takes the fused loss: with ``fused_kernels`` on, a training step of ``ParallelTrainer``
(one process) runs ``moe_engine::linear_cross_entropy`` and no ``log_softmax``, and gives the loss and
gradients of the same step unfused, in fp32, within the model's error-analysis tolerance."""

import dataclasses
from collections import Counter

import torch
from fused_cases import MODEL_CONFIG, SEED, model_batch
from tolerances import assert_close_to_scale, model_tolerance
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine import ModelConfig
from moe_engine.config import OptimizerConfig, ParallelConfig
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

CONFIG = ModelConfig(**MODEL_CONFIG)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def one_step(fused: bool):
    parallel = ParallelConfig(microbatches=2)
    rank_model = build_rank_model(
        dataclasses.replace(CONFIG, fused_kernels=fused), parallel, None, torch.device("cpu"), SEED
    )
    trainer = ParallelTrainer(rank_model, parallel, None, OptimizerConfig(lr=0.0))
    grad_of = getattr(trainer.optimizer, "grad_view", lambda param: param.grad)
    tokens, labels = model_batch(vocab=CONFIG.vocab_size)
    with _Ops() as ops:
        loss = trainer.step(tokens, labels)
    grads = {n: grad_of(p).clone() for n, p in rank_model.module.named_parameters()}
    return loss, grads, ops.names


def test_the_trainer_runs_the_fused_loss_and_matches_the_unfused_step():
    fused_loss, fused_grads, fused_ops = one_step(fused=True)
    loss, grads, ops = one_step(fused=False)
    assert fused_ops["linear_cross_entropy"] == 2 and "_log_softmax" not in fused_ops  # one per microbatch
    assert ops["_log_softmax"] == 2 and "linear_cross_entropy" not in ops
    tokens = model_batch()[0].numel()
    assert_close_to_scale(fused_loss, loss, model_tolerance(CONFIG, tokens, gradients=False), msg=f"seed {SEED}")
    tol = model_tolerance(CONFIG, tokens)
    for name, grad in grads.items():
        assert_close_to_scale(fused_grads[name], grad, tol, msg=f"{name}, seed {SEED}")
