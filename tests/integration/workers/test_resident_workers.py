"""Resident A/B workers as processes: blocks, failures, two-rank sides, a release's checkout."""

from __future__ import annotations

import math
import os
import signal

import pytest
from own_processes import owned_processes, owned_processes_after, owner_env

from bench.ab.resident import ResidentSide, WorkerDied, WorkerFailedToStart
from bench.results import REPO_ROOT
from bench.scenario import scenario_from_dict

TINY = {
    "schema_version": 1,
    "description": "A tiny MoE for the resident-worker tests.",
    "mode": "execute",
    "model": {
        "vocab_size": 256,
        "d_model": 64,
        "n_layers": 1,
        "n_heads": 4,
        "n_kv_heads": 2,
        "seq_len": 32,
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
    },
    "routing": {"mode": "random", "seed": 3},
    "precision": "fp32",
    "run": {"warmup_steps": 1, "steps": 2, "tokens_per_step": 128, "timeout_s": 120},
}


@pytest.fixture
def owner(monkeypatch) -> dict[str, str]:
    """This test's process marker, set where the sides' processes inherit it: only they are looked for."""
    env = owner_env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def scenario(**parallel):
    spec = {**TINY, "parallel": parallel} if parallel else dict(TINY)
    return scenario_from_dict(spec, "tiny-resident.yaml")


@pytest.mark.slow
def test_both_sides_replay_the_same_steps_block_after_block():
    tiny = scenario()
    with ResidentSide("a", REPO_ROOT, tiny, "cpu", 120) as a, ResidentSide("b", REPO_ROOT, tiny, "cpu", 120) as b:
        for _ in range(3):
            a.block(2), b.block(2)
            assert a.last_losses == pytest.approx(b.last_losses, rel=1e-5) and len(a.last_losses) == 2
        first = a.last_losses
        a.block(2)
        assert a.last_losses != first  # the model trains on: same data, new parameters


def test_a_worker_that_dies_fails_with_its_error_and_leaves_nothing(owner):
    tiny = scenario()
    with ResidentSide("candidate", REPO_ROOT, tiny, "cpu", 60) as side:
        side.block(1)
        assert side.process.pid in owned_processes(owner)
        os.kill(side.process.pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="candidate worker exited with code -9"):
            side.block(1)
    assert owned_processes_after(owner) == []


def test_a_worker_that_cannot_start_says_why(tmp_path):
    broken = tmp_path / "tree"
    (broken / "bench").mkdir(parents=True)
    (broken / "bench" / "__init__.py").write_text("")
    (broken / "bench" / "scenario.py").write_text("raise ImportError('this tree has no scenario loader')\n")
    with pytest.raises(
        WorkerFailedToStart, match=r"tiny-resident: baseline worker exited .*this tree has no scenario loader"
    ):
        with ResidentSide("baseline", broken, scenario(), "cpu", 60):
            pass


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_two_rank_side_runs_blocks_and_closes_all_its_ranks(owner):
    ep2 = scenario(dp=2, ep=2, dispatch="no-sync")
    with ResidentSide("a", REPO_ROOT, ep2, "cpu", 180) as a:
        seconds = a.block(2)
        assert seconds > 0 and len(a.last_losses) == 2
        assert len(owned_processes(owner)) >= 2  # rank 0 and rank 1
    assert owned_processes_after(owner) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_worker_drives_the_latest_release_as_it_drives_this_checkout(tmp_path, owner):
    """The worker script is this checkout's; the code it drives is each side's own. The gate's baseline
    is the latest release, whose scenario sections may predate the typed ones (0.2.0's are dicts), so
    the script must run a block on that tree too, replaying the steps this checkout replays."""

    import yaml

    from bench.ab.gate import worktree
    from bench.release.git import try_git
    from bench.release.record import latest_release

    release = latest_release()
    if (
        release is None
        or try_git(REPO_ROOT, "rev-parse", "--verify", "--quiet", f"{release.commit}^{{commit}}") is None
    ):
        pytest.skip("the latest release's commit is not in this checkout's history")
    file = tmp_path / "tiny-release.yaml"
    file.write_text(yaml.safe_dump(TINY))
    tiny = scenario_from_dict(TINY, str(file))
    with worktree(REPO_ROOT, release.commit) as release_root:
        with (
            ResidentSide("release", release_root, tiny, "cpu", 180) as old,
            ResidentSide("here", REPO_ROOT, tiny, "cpu", 180) as new,
        ):
            assert old.block(2) > 0 and new.block(2) > 0
    assert len(old.last_losses) == 2 and all(math.isfinite(loss) for loss in old.last_losses)
    assert old.last_losses == pytest.approx(new.last_losses, rel=1e-4)
    assert owned_processes_after(owner) == []
