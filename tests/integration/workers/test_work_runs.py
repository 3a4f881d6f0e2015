"""Work counters of real runs: identical runs write identical work; an extra collective is named."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import run_ranks
from scenario_files import variant, write_scenario
from work_runs import TINY_UNFUSED, execute_once, run_gate, work_census, write_sides

from bench.cli import main
from bench.gate.work import work_verdicts
from bench.results import load_results
from bench.run.work import WORK_METRICS as WRITTEN
from bench.scenario import scenario_from_dict
from moe_engine.parallel.trainer import ParallelTrainer


@pytest.mark.slow
def test_two_runs_of_a_scenario_write_identical_work_and_the_gate_passes(tmp_path):
    scenario = write_scenario(tmp_path, "tiny", TINY_UNFUSED)
    out = tmp_path / "results"
    for _ in range(2):
        assert main(["run", str(scenario), "--out", str(out), "--device", "cpu", "--no-plots"]) == 0
    first, second = sorted(load_results(out), key=lambda d: str(d.path))
    for name in WRITTEN:
        assert first.metrics[name] == second.metrics[name], name
    assert work_census(first.data["details"]) == work_census(second.data["details"])
    assert work_verdicts("tiny", first, second) == []


# ---- a planted collective on two gloo ranks ----------------------------------------------------------

DP2 = variant(parallel={"dp": 2})
EXTRA_ELEMENTS = 1 << 20  # 4 MiB of fp32


def _two_runs_with_an_extra_all_reduce():
    """On every rank: the dp2 scenario as it is, then with one more 4 MiB all-reduce over dp a step."""
    import torch.distributed as dist

    from moe_engine.parallel.groups import build_process_groups
    from moe_engine.parallel.layout import Layout

    groups = build_process_groups(Layout(scenario_from_dict(DP2).parallel_config))
    base = execute_once(DP2, groups)
    original = ParallelTrainer.step

    def step(self, tokens, labels):
        loss = original(self, tokens, labels)
        dist.all_reduce(torch.zeros(EXTRA_ELEMENTS), group=self.groups.dp)
        return loss

    ParallelTrainer.step = step
    try:
        planted = execute_once(DP2, groups)
    finally:
        ParallelTrainer.step = original
    return base, planted


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_extra_all_reduce_is_named_in_the_gate(tmp_path):
    (base, planted), _ = run_ranks(_two_runs_with_an_extra_all_reduce, 2, timeout=240)

    def census(run):
        return {
            r["rank"]: {(c["op"], c["group"]): (c["calls"], c["bytes"]) for c in r["collectives"]}
            for r in run[1]["work"]["ranks"]
        }

    before, after = census(base), census(planted)
    assert set(before) == {0, 1}
    for rank in (0, 1):
        calls, nbytes = before[rank][("all_reduce", "dp")]
        assert after[rank][("all_reduce", "dp")] == (calls + 1, nbytes + 4 * EXTRA_ELEMENTS)
        assert {k: v for k, v in after[rank].items() if k != ("all_reduce", "dp")} == {
            k: v for k, v in before[rank].items() if k != ("all_reduce", "dp")
        }
    assert planted[0]["work_collective_calls"]["median"] == base[0]["work_collective_calls"]["median"] + 2

    base_dir, cand_dir = write_sides(tmp_path, base, planted, "tiny-dp2", DP2)
    code, report = run_gate("--baseline", str(base_dir), "--candidate", str(cand_dir))
    assert code == 1, report
    assert (
        "REGRESSION tiny-dp2 work_collective_calls: work increased: +1 all_reduce of 4 MiB per step (dp) "
        "on each of 2 ranks"
    ) in report
    assert "REGRESSION tiny-dp2 work_collective_bytes: work increased: +8 MiB of collectives per step" in report
    code, report = run_gate("--baseline", str(base_dir), "--candidate", str(cand_dir), "--accept-work")
    assert code == 0 and "work increased (accepted): +1 all_reduce of 4 MiB per step (dp)" in report
