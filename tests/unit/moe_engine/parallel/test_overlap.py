"""The Interleaver alone (no process groups): strict alternation at each all-to-all, errors, host-sync guard."""

import pytest
import torch

from moe_engine.host_sync import HostSyncError, forbid_host_sync
from moe_engine.moe import dispatch
from moe_engine.parallel.overlap import Interleaver


def _program(name: str, steps: int, log: list[str]):
    def run():
        for k in range(steps):
            log.append(f"{name}{k}")
            # Where the dispatcher starts an all-to-all and would wait for it.
            dispatch.in_flight_hook()
        log.append(f"{name}-end")
        return name

    return run


def test_programs_alternate_at_each_all_to_all_and_the_survivor_runs_alone():
    log: list[str] = []
    events: list = []
    results = Interleaver(events).run(_program("a", 3, log), _program("b", 1, log))
    assert results == ("a", "b")
    assert log == ["a0", "b0", "a1", "b-end", "a2", "a-end"]
    assert events == [("run", 0), ("run", 1), ("run", 0), ("run", 1), ("done", 1), ("run", 0), ("done", 0)]
    assert dispatch.in_flight_hook is None


def test_an_error_in_either_program_reaches_the_caller_and_releases_the_other():
    log: list[str] = []

    def failing():
        dispatch.in_flight_hook()
        raise ValueError("planted")

    with pytest.raises(ValueError, match="planted"):
        Interleaver().run(failing, _program("b", 3, log))
    assert log[-1] == "b-end" and dispatch.in_flight_hook is None


def test_the_programs_run_under_the_callers_host_sync_guard():
    x = torch.ones(2)

    def syncs():
        dispatch.in_flight_hook()
        return x.sum().item()

    with forbid_host_sync(), pytest.raises(HostSyncError):
        Interleaver().run(lambda: x * 2, syncs)
    assert Interleaver().run(lambda: x * 2, syncs)[1] == 2.0


def test_the_programs_keep_the_callers_grad_mode():
    w = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        out, _ = Interleaver().run(lambda: w * 2, lambda: None)
    assert not out.requires_grad
    out, _ = Interleaver().run(lambda: w * 2, lambda: None)
    assert out.requires_grad


def test_a_full_recompute_of_moe_blocks_runs_the_plain_order():
    # The replay sets a layer's routing streams back to its forward's for the recompute: the other
    # microbatch's forward must not run inside that window.
    from moe_engine import build_model
    from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig, RecomputeConfig
    from moe_engine.parallel.overlap import overlaps_microbatches
    from moe_engine.parallel.trainer import prepare_blocks

    config = ModelConfig(
        vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, seq_len=4,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=8),
    )  # fmt: skip
    auto = ParallelConfig(dp=2, ep=2, microbatches=2)
    explicit = ParallelConfig(dp=2, ep=2, microbatches=2, overlap="microbatches")

    def model(**recompute):
        built = build_model(config)
        prepare_blocks(built, auto, RecomputeConfig(**recompute) if recompute else None, compile=False)
        return built

    assert overlaps_microbatches(auto, model()) and overlaps_microbatches(explicit, model())
    selective = model(mode="selective", parts=["experts"])
    assert overlaps_microbatches(auto, selective)
    full = model(mode="full")
    assert not overlaps_microbatches(auto, full)
    with pytest.raises(ValueError, match="full recompute"):
        overlaps_microbatches(explicit, full)
