"""moe-bench run with checkpoints: kill -9 while saving or mid-run, then --resume; bad input.

The reference is the same scenario run once without a stop (its own results root). Random routing
and fp32: the resumed run's per-step losses must equal the reference's exactly. Kills are real
SIGKILLs, planted by a ``sitecustomize`` on the workers' PYTHONPATH: on the n-th DCP metadata
write (mid-save: the shard files are written, the checkpoint is not complete) or on the n-th
training step of one rank.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
from scenario_files import write_scenario

from bench.cli import main
from bench.results import REPO_ROOT, load_results

TINY_CKPT = {
    "schema_version": 1,
    "mode": "execute",
    "model": {
        "vocab_size": 256,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "seq_len": 32,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
    },
    "routing": {"mode": "random", "seed": 3},
    "precision": "fp32",
    "run": {"warmup_steps": 1, "steps": 6, "tokens_per_step": 256, "timeout_s": 120},
    "checkpoint": {"every_steps": 2},
}

KILLER = textwrap.dedent("""
    import os, signal
    _plan = os.environ.get("MOE_TEST_KILL")
    if _plan and os.environ.get("RANK", "0") == os.environ.get("MOE_TEST_KILL_RANK", "0"):
        _kind, _n = _plan.split(":")
        _calls = [0]

        def _counted(fn):
            def wrapper(*args, **kwargs):
                _calls[0] += 1
                if _calls[0] == int(_n):
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*args, **kwargs)
            return wrapper

        if _kind == "save":
            from torch.distributed.checkpoint import FileSystemWriter
            FileSystemWriter.finish = _counted(FileSystemWriter.finish)
        else:
            from moe_engine.parallel.trainer import ParallelTrainer
            ParallelTrainer.step = _counted(ParallelTrainer.step)
""")


def _scenario(folder: Path, name: str, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads(json.dumps(TINY_CKPT))
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value}
    return write_scenario(folder, name, data)


def _run(files: list[Path], out: Path, *extra: str, kill: str | None = None, kill_rank: int = 0) -> int:
    old = dict(os.environ)
    if kill:
        hooks = out.parent / "hooks"
        hooks.mkdir(exist_ok=True)
        (hooks / "sitecustomize.py").write_text(KILLER)
        os.environ.update(
            PYTHONPATH=f"{hooks}{os.pathsep}{REPO_ROOT}", MOE_TEST_KILL=kill, MOE_TEST_KILL_RANK=str(kill_rank)
        )
    try:
        return main(["run", *map(str, files), "--out", str(out), "--device", "cpu", "--no-plots", *extra])
    finally:
        os.environ.clear()
        os.environ.update(old)


def _docs(out: Path) -> list:
    return sorted(load_results(out), key=lambda d: d.data["timestamp"]) if out.exists() else []


def _losses(doc) -> list[float]:
    return doc.data["metrics"]["loss"]["samples"]


@pytest.mark.slow
def test_kill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path):
    scenario = _scenario(tmp_path, "ck")
    assert _run([scenario], tmp_path / "reference") == 0
    reference = _docs(tmp_path / "reference")[0]

    out = tmp_path / "killed"
    assert _run([scenario], out, kill="save:2") == 1  # killed writing step 4's metadata
    root = out / "checkpoints" / "ck"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000002", "step-00000004.partial"]
    assert _run([scenario], out, "--resume") == 0
    first, resumed = _docs(out)
    assert first.data["status"] in ("failed", "oom")
    details = resumed.data["details"]["checkpoint"]
    assert details["resumed_from"].endswith("step-00000002") and details["steps_from_earlier_attempts"] == 2
    assert _losses(resumed) == _losses(reference)
    # The partial folder is gone, the newest two complete checkpoints stay (keep: 2).
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000004", "step-00000006"]


@pytest.mark.slow
def test_a_rank_killed_mid_run_then_resumed_loses_no_step(tmp_path):
    scenario = _scenario(tmp_path, "ck-dp2", parallel={"dp": 2})
    assert _run([scenario], tmp_path / "reference") == 0
    reference = _docs(tmp_path / "reference")[0]

    out = tmp_path / "killed"
    # Rank 1 dies at the start of step 5 (index 4), after the checkpoint of step 4.
    assert _run([scenario], out, kill="step:5", kill_rank=1) == 1
    assert _run([scenario], out, "--resume") == 0
    failed, resumed = _docs(out)
    assert failed.data["status"] in ("failed", "oom") and failed.data["scenario"]["name"] == "ck-dp2"
    details = resumed.data["details"]["checkpoint"]
    earlier = details["earlier_attempts"]
    assert [a["attempt"] for a in earlier] == [1] and earlier[0]["status"] in ("failed", "oom")
    assert earlier[0]["checkpoints"] == [2, 4] and details["attempt"] == 2
    # Steps 0-3 come from the killed attempt's journal, 4-6 from the resumed one: every measured step.
    assert details["resumed_from_step"] == 4 and details["steps_from_earlier_attempts"] == 4
    assert _losses(resumed) == _losses(reference) and len(_losses(resumed)) == 6
    assert len(resumed.data["metrics"]["step_time_s"]["samples"]) == 6


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, target)
    return {k: v for k, v in torch.load(target, weights_only=False).items() if torch.is_tensor(v)}


@pytest.mark.slow
def test_async_checkpoints_hold_what_sync_ones_hold(tmp_path):
    sync = _scenario(tmp_path, "ck")
    asynchronous = _scenario(tmp_path / "a", "ck", checkpoint={"async": True})
    assert _run([sync], tmp_path / "sync") == 0 and _run([asynchronous], tmp_path / "async") == 0
    doc = _docs(tmp_path / "async")[0]
    metrics = doc.data["metrics"]
    assert len(metrics["checkpoint_stall_s"]["samples"]) == 3 and metrics["checkpoint_bytes_total"]["median"] > 0
    step = Path("checkpoints") / "ck" / "step-00000006"
    a, b = _tensors(tmp_path / "sync" / step), _tensors(tmp_path / "async" / step)
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _refused(capsys, code: int, out: Path, *needles: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err
    assert not _docs(out), "nothing may run"


def test_bad_checkpoints_are_refused_before_any_step(tmp_path, capsys):
    scenario = _scenario(tmp_path, "ck", run={"steps": 1})
    out = tmp_path / "results"
    root = out / "checkpoints" / "ck"
    _refused(capsys, _run([scenario], out, "--resume"), out, str(root), "no such checkpoint or folder")

    partial = root / "step-00000002"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"")
    _refused(capsys, _run([scenario], out, "--resume", str(partial)), out, str(partial), "incomplete checkpoint")
    _refused(capsys, _run([scenario], out, "--resume"), out, str(root), "holds no complete checkpoint")

    unwritable = _scenario(tmp_path, "ck-file", checkpoint={"dir": str(tmp_path / "ck-file.yaml" / "sub")})
    _refused(capsys, _run([unwritable], out), out, str(tmp_path / "ck-file.yaml" / "sub"), "cannot write checkpoints")


@pytest.mark.slow
def test_a_checkpoint_of_another_model_or_an_earlier_run_is_refused(tmp_path, capsys):
    small = _scenario(tmp_path, "ck", run={"steps": 1})
    out = tmp_path / "results"
    assert _run([small], out) == 0
    saved = out / "checkpoints" / "ck" / "step-00000002"
    assert saved.is_dir()
    capsys.readouterr()
    before = len(_docs(out))
    code = _run([small], out)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "holds checkpoints of an earlier run (latest step-00000002)" in err
    wider = _scenario(tmp_path, "ck-wide", model={"d_model": 96}, run={"steps": 1})
    code = _run([wider], out, "--resume", str(saved))
    err = capsys.readouterr().err.strip()
    assert code == 2 and str(saved) in err and "model.d_model is 64 there, 96 in ck-wide" in err, err
    assert len(_docs(out)) == before
