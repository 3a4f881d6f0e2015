"""Every component of a built model is chosen at its construction, from the configs: the fused
kernels' switch of each module and the dispatcher of each MoE layer (class, settings, groups, held
experts), with no call after the build. The expectations are written out from the configs here, not
read back from the engine's own mapping.
"""

import dataclasses

import pytest
import torch
from component_models import GQA

from moe_engine import build_model
from moe_engine.config import ParallelConfig
from moe_engine.model import Block, Transformer
from moe_engine.modules.mlp import SwiGLU
from moe_engine.modules.norm import RMSNorm
from moe_engine.modules.rope import RotaryEmbedding
from moe_engine.moe.dispatch import AllToAllDispatcher, LocalDispatcher
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.layer import MoELayer
from moe_engine.moe.router import Router

# Multi-head latent attention: its own norms (query and key-value latents).
MLA = dataclasses.replace(
    GQA,
    head_dim=None,
    qk_norm=False,
    n_kv_heads=4,
    mla=dict(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4),
)

# Module kinds that take the switch, and how many of each the configs above build (by hand:
# norms: 2 per block + final (+ 2 qk-norms per block, or 2 latent norms per MLA block); SwiGLU: the
# dense block's FFN + one shared expert per MoE block).
SWITCHED = (Transformer, Block, RMSNorm, SwiGLU, RotaryEmbedding, Router, GroupedExperts, MoELayer)
COUNTS = {
    "gqa": {Transformer: 1, Block: 3, RMSNorm: 13, SwiGLU: 3, RotaryEmbedding: 1, Router: 2},
    "mla": {Transformer: 1, Block: 3, RMSNorm: 13, SwiGLU: 3, RotaryEmbedding: 1, Router: 2},
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_a_built_model_holds_the_switch_of_its_config_in_every_module(name, fused):
    config = dataclasses.replace({"gqa": GQA, "mla": MLA}[name], fused_kernels=fused)
    model = build_model(config)
    found = {kind: [m for m in model.modules() if type(m) is kind] for kind in SWITCHED}
    for kind, count in COUNTS[name].items():
        assert len(found[kind]) == count, kind.__name__
    for kind, modules in found.items():
        assert all(m.fused_kernels is fused for m in modules), kind.__name__
    for layer in found[MoELayer]:
        assert type(layer.dispatcher) is LocalDispatcher and layer.dispatcher.fused_kernels is fused
        assert layer.experts.backend.fused_swiglu is fused
        assert layer.experts.global_experts == range(8)
    # Every other module says nothing about fused kernels: none was missed above.
    assert not [type(m).__name__ for m in model.modules() if type(m) not in SWITCHED and hasattr(m, "fused_kernels")]


def test_a_model_built_with_the_other_switch_takes_the_same_weights_and_loss():
    """The eager model is built from its own config and given the fused one's weights: the same
    parameter names and shapes, and, on a CPU where the fused ops run their eager compositions, the
    same loss."""
    tokens = torch.randint(0, GQA.vocab_size, (2, GQA.seq_len), generator=torch.Generator().manual_seed(3))
    fused = build_model(GQA, seed=5)
    eager = build_model(dataclasses.replace(GQA, fused_kernels=False), seed=6)
    eager.load_state_dict(fused.state_dict())
    torch.testing.assert_close(fused.loss(tokens, tokens), eager.loss(tokens, tokens), rtol=1e-6, atol=1e-6)


def test_a_spec_refuses_what_its_layout_cannot_hold():
    with pytest.raises(ValueError, match="need an expert-parallel group"):
        DispatchSpec(ep=2)
    assert DispatchSpec.from_parallel(ParallelConfig(), None).local
    assert DispatchSpec().local_experts(6) == range(6)
    assert isinstance(DispatchSpec().build(GQA.moe, 16, 1, True), LocalDispatcher)
    assert not isinstance(DispatchSpec().build(GQA.moe, 16, 1, True), AllToAllDispatcher)
