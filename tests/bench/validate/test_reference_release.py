"""The reference-release comparison's lean engine and its verdicts, without projecting (that takes minutes)."""

from __future__ import annotations

from bench.scenario import load_scenario
from bench.validate.reference_release import QWEN_ON_H100, SCENARIOS, _error, lean
from bench.validate.variants import patched


def test_lean_turns_on_the_fused_kernels_and_chunks_only_expert_parallel_all_to_alls():
    ep = load_scenario(SCENARIOS / "olmo-core3" / "moe-128e-47b.yaml")
    assert not ep.model.fused_kernels and ep.parallel_config.a2a_chunks == 1
    lean_ep = lean(ep)
    assert lean_ep.model.fused_kernels and lean_ep.parallel_config.a2a_chunks == 2
    # Everything else as the file says.
    assert lean_ep.parallel_config.ep == ep.parallel_config.ep and lean_ep.run == ep.run
    fsdp = load_scenario(SCENARIOS / "olmo-core3" / "moe-128e-47b-fsdp.yaml")
    assert fsdp.parallel_config.ep == 1
    assert lean(fsdp).model.fused_kernels and lean(fsdp).parallel_config.a2a_chunks == 1


def test_the_qwen_layout_is_megatron_bridges():
    qwen = patched(load_scenario(SCENARIOS / "models" / "qwen3-30b-a3b.yaml"), QWEN_ON_H100)
    p = qwen.parallel_config
    assert (p.dp, p.ep, p.pp, p.microbatches, qwen.world_size) == (16, 16, 1, 64, 16)
    # Global batch 1,024 sequences of 4,096 tokens, one sequence per microbatch per rank.
    assert qwen.run.tokens_per_step // qwen.model.seq_len // p.dp // p.microbatches == 1


def test_errors_by_hand():
    assert _error(52_000, 39_000, "tokens/s/GPU") == 39_000 / 52_000 - 1
    assert _error("< 5%", 0.03, "throughput loss") == "within the bound"
    assert _error("< 5%", 0.08, "throughput loss") == "outside the bound"
    assert _error("fits 74.5", "74.4", "GiB per GPU") == "fits"
    assert _error("fits 74.5", "82.3", "GiB per GPU") == "does not fit"
    assert _error("103 -> 95", "90 -> 80", "GiB per GPU") is None
