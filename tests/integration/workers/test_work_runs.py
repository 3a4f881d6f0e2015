"""Work counters of real runs: identical runs write identical work; an extra collective is named."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from distributed_harness import run_ranks
from result_docs import make_doc
from test_runner import variant, write_scenario

from bench.cli import main
from bench.gate.work import work_verdicts
from bench.results import load_results, write_result
from bench.run.execute import execute
from bench.run.work import WORK_METRICS as WRITTEN
from bench.run.worker_protocol import Peaks
from bench.scenario import scenario_from_dict
from moe_engine.model import Block, Transformer
from moe_engine.parallel.trainer import ParallelTrainer

CPU = torch.device("cpu")


# ---- the counters, by hand ---------------------------------------------------------------------


# ---- an execute run --------------------------------------------------------------------------------


# fp32, 2 layers, 8 experts top-2, random routing, 128 tokens a step; the reference (unfused) step,
# whose FLOPs the hand count below restates op by op.
TINY = variant(model__fused_kernels=False)


def _execute(spec=TINY, groups=None):
    torch.manual_seed(0)
    result = execute(scenario_from_dict(spec), CPU, Peaks(), groups=groups)
    return None if result is None else (result.metrics, result.details)


def _census(details) -> list[dict]:
    return [{k: v for k, v in rank.items() if k != "seconds"} for rank in details["work"]["ranks"]]


@pytest.mark.slow
def test_two_runs_of_a_scenario_write_identical_work_and_the_gate_passes(tmp_path):
    scenario = write_scenario(tmp_path, "tiny", TINY)
    out = tmp_path / "results"
    for _ in range(2):
        assert main(["run", str(scenario), "--out", str(out), "--device", "cpu", "--no-plots"]) == 0
    first, second = sorted(load_results(out), key=lambda d: str(d.path))
    for name in WRITTEN:
        assert first.metrics[name] == second.metrics[name], name
    assert _census(first.data["details"]) == _census(second.data["details"])
    assert work_verdicts("tiny", first, second) == []


# ---- planted changes and the gate --------------------------------------------------------------


def _only_work(metrics: dict) -> dict:
    # Timings of two in-process runs differ by noise: the gate below is on the work counters alone.
    return {name: entry for name, entry in metrics.items() if name.startswith("work_")}


def _write_side(tmp_path: Path, label: str, name: str, run, spec=TINY) -> Path:
    metrics, details = run
    doc = make_doc(name, _only_work(metrics), spec=spec)
    doc["details"] = json.loads(json.dumps(details))
    folder = tmp_path / label
    write_result(doc, folder / "v" / "m")
    return folder


def _sides(tmp_path: Path, base, cand, name: str = "tiny", spec=TINY) -> tuple[Path, Path]:
    return _write_side(tmp_path, "base", name, base, spec), _write_side(tmp_path, "cand", name, cand, spec)


def _gate(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["gate", *argv])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def runs():
    """The tiny scenario as it is, with an extra copy in every block, and with an extra host sync."""
    base = _execute()
    original_block, original_model = Block.forward, Transformer.forward
    try:
        Block.forward = lambda self, x, rope: original_block(self, x, rope).clone()
        copied = _execute()
        Block.forward = original_block

        def syncing(self, tokens):
            logits = original_model(self, tokens)
            logits.detach()[0, 0, 0].item()
            return logits

        Transformer.forward = syncing
        synced = _execute()
    finally:
        Block.forward, Transformer.forward = original_block, original_model
    return {"base": base, "copy": copied, "sync": synced}


# ---- a planted collective on two gloo ranks ----------------------------------------------------------

DP2 = variant(parallel={"dp": 2})
EXTRA_ELEMENTS = 1 << 20  # 4 MiB of fp32


def _two_runs_with_an_extra_all_reduce():
    """On every rank: the dp2 scenario as it is, then with one more 4 MiB all-reduce over dp a step."""
    import torch.distributed as dist

    from moe_engine.parallel.groups import build_process_groups
    from moe_engine.parallel.layout import Layout

    groups = build_process_groups(Layout(scenario_from_dict(DP2).parallel_config))
    base = _execute(DP2, groups)
    original = ParallelTrainer.step

    def step(self, tokens, labels):
        loss = original(self, tokens, labels)
        dist.all_reduce(torch.zeros(EXTRA_ELEMENTS), group=self.groups.dp)
        return loss

    ParallelTrainer.step = step
    try:
        planted = _execute(DP2, groups)
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

    base_dir, cand_dir = _sides(tmp_path, base, planted, "tiny-dp2", DP2)
    code, report = _gate("--baseline", str(base_dir), "--candidate", str(cand_dir))
    assert code == 1, report
    assert (
        "REGRESSION tiny-dp2 work_collective_calls: work increased: +1 all_reduce of 4 MiB per step (dp) "
        "on each of 2 ranks"
    ) in report
    assert "REGRESSION tiny-dp2 work_collective_bytes: work increased: +8 MiB of collectives per step" in report
    code, report = _gate("--baseline", str(base_dir), "--candidate", str(cand_dir), "--accept-work")
    assert code == 0 and "work increased (accepted): +1 all_reduce of 4 MiB per step (dp)" in report
