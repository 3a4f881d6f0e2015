"""The reference-release comparison's two engines and its verdicts, without projecting (that takes minutes)."""

from __future__ import annotations

from bench.scenario import load_scenario
from bench.validate.reference_release import QWEN_ON_H100, SCENARIOS, _error, breakdown_table, reference_path
from bench.validate.variants import patched


def test_shipped_scenarios_run_the_fast_path_and_the_reference_path_turns_it_off():
    ep = load_scenario(SCENARIOS / "olmo-core3" / "moe-128e-47b.yaml")
    p = ep.parallel_config
    # As shipped: fused kernels, rows per destination, the overlap the layout chooses (pp 1, 32 microbatches).
    assert ep.model.fused_kernels
    assert (p.dispatch_rows.value, p.resolved_overlap.value) == ("auto", "microbatches")
    ref = reference_path(ep)
    assert not ref.model.fused_kernels
    rp = ref.parallel_config
    assert (rp.dispatch_rows.value, rp.resolved_overlap.value, rp.a2a_chunks) == ("per-expert", "none", 1)
    # Everything else as the file says.
    assert rp.ep == p.ep and ref.run == ep.run


def test_the_1_2t_scenario_ships_a_schedule_that_overlaps():
    big = load_scenario(SCENARIOS / "olmo-core3" / "moe-1.2t-512gpu.yaml")
    p = big.parallel_config
    assert (p.pp, p.dp, p.ep) == (8, 64, 64)
    assert (p.schedule.value, p.virtual_stages) == ("interleaved1f1b", 7) and p.resolved_overlap.value == "microbatches"


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


def test_breakdown_table_by_hand():
    b = {"expert_comm_total": 10.0, "expert_comm": 1.5, "compute": 20.0, "bubble": 0.25}
    report = {"projections": {"x (shipped)": {"step_s": 22.0, "breakdown_s": b}, "y (shipped)": {}}}
    lines = breakdown_table(report).splitlines()
    assert lines[2] == "| x (shipped) | 22.00 | 20.00 | 10.00, 1.50 (15%) | 0.25 |"
    assert lines[3] == "| y (shipped) | does not fit | | | |"
