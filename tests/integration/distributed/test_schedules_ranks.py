"""Pipeline schedules and the overlapped step on gloo ranks against 1F1B and the plain step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from overlap_checks import overlap_violations

from moe_engine.config import ExpertOverlap, ModelConfig, MoEConfig, ParallelConfig
from moe_engine.parallel import overlap, pipeline
from moe_engine.parallel.data_parallel import DataParallelOptimizer
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model
from moe_engine.train import OptimizerConfig

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, aux_loss_weight=0.01, shared_expert_hidden=16),
)
LOOP_CONFIG = dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, backend="loop"))
OPTIMIZER = OptimizerConfig(lr=1.0, eps=1.0, weight_decay=0.0, max_grad_norm=0.1)
SEQUENCES, STEPS = 8, 2
# Fixed, so that a failure replays exactly (the model's init and the batches derive from it).
SEED = 1234
TIMEOUT = 240


class _Recorder:
    """Records this rank's collectives per group and the expert all-to-alls' starts and waits."""

    def __init__(self):
        self.collectives: dict[tuple[int, ...], list[str]] = {}
        self.events: list[tuple] = []
        self.pairs: list[tuple[str, str]] = []

    def install(self) -> None:
        for name in ("all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast"):
            setattr(dist, name, self._wrap(name, getattr(dist, name)))
        events = self.events
        overlap.Interleaver._record = lambda self, kind, p: events.append((kind, p))  # type: ignore[method-assign]
        # The pipeline registers its pair runner when built, after this: each pair's kinds, as run.
        run_pair, pairs = pipeline._run_pair, self.pairs

        def recorded_pair(action, ctx):
            pairs.append(tuple(a.computation_type.value for a in action.sub_actions))
            return run_pair(action, ctx)

        pipeline._run_pair = recorded_pair
        # A weight backward's slices beside a backward (not a program of their own: -1).
        run_slice = pipeline._WeightSlices._run_slice

        def recorded_slice(slices):
            if slices.groups:
                events.append(("slice", -1))
            return run_slice(slices)

        pipeline._WeightSlices._run_slice = recorded_slice  # type: ignore[method-assign]

    def _wrap(self, name, fn):
        recorder = self

        def wrapped(*args, group=None, async_op=False, **kwargs):
            ranks = (
                tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
            )
            recorder.collectives.setdefault(ranks, []).append(name)
            program = recorder._program()
            exchange = len(recorder.events)
            if name == "all_to_all_single":
                recorder.events.append(("start", program, exchange))
            work = fn(*args, group=group, async_op=async_op, **kwargs)
            if name != "all_to_all_single":
                return work
            if not async_op:
                recorder.events.append(("wait", program, exchange))
                return work
            return _RecordedWork(work, recorder, program, exchange)

        return wrapped

    @staticmethod
    def _program() -> int:
        from moe_engine.moe import dispatch

        # Only an interleaved pair's hook is a program's; a weight backward's slices run in no program.
        owner = getattr(dispatch.in_flight_hook, "__self__", None)
        return owner.active if isinstance(owner, overlap.Interleaver) else -1


class _RecordedWork:
    def __init__(self, work, recorder: _Recorder, program: int, exchange: int):
        self.work, self.recorder, self.program, self.exchange = work, recorder, program, exchange

    def wait(self, *args, **kwargs):
        self.recorder.events.append(("wait", self.program, self.exchange))
        return self.work.wait(*args, **kwargs)


def _batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (SEQUENCES, CONFIG.seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def _trace_weight_gradients(module: torch.nn.Module) -> list[tuple[str, str]]:
    """(action, parameter) of every expert weight gradient accumulated, the action being the pipeline
    stage call running then: "I" (input backward), "W" (weight backward) or "B" (full backward)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    current = ["-"]
    trace: list[tuple[str, str]] = []

    def traced(method, kind_of):
        def run(self, *args, **kwargs):
            current[0] = kind_of(kwargs)
            try:
                return method(self, *args, **kwargs)
            finally:
                current[0] = "-"

        return run

    base = _PipelineStageBase
    base.backward_one_chunk = traced(base.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I")  # type: ignore[method-assign]
    base.backward_weight_one_chunk = traced(base.backward_weight_one_chunk, lambda kw: "W")  # type: ignore[method-assign]
    for name, param in module.named_parameters():
        if ".experts." in name:
            # A tensor hook: the W action hands its gradients to autograd.grad, not to AccumulateGrad.
            param.register_hook(lambda grad, name=name: trace.append((current[0], name)))
    return trace


def _train_rank(
    parallel: ParallelConfig, seed: int, config: ModelConfig = CONFIG, guard: bool = False, trace_weights: bool = False
):
    recorder = _Recorder()
    recorder.install()
    groups = build_process_groups(Layout(parallel))
    rank_model = build_rank_model(config, parallel, groups, torch.device("cpu"), seed)
    trainer = ParallelTrainer(rank_model, parallel, groups, OPTIMIZER)
    weight_trace = _trace_weight_gradients(rank_model.module) if trace_weights else []
    share = SEQUENCES // parallel.dp
    rows = slice(groups.coords.dp_rank * share, (groups.coords.dp_rank + 1) * share)
    launched_in_backward: list[int] = []
    if isinstance(trainer.optimizer, DataParallelOptimizer):
        trainer.optimizer.sync_observer = _LaunchCounter(trainer.optimizer, launched_in_backward)
    losses = []
    if guard:
        # Forward and backward (the optimizer's step is not part of the no-sync promise).
        from moe_engine.host_sync import forbid_host_sync

        accumulate = trainer._accumulate

        def guarded(*args):
            with forbid_host_sync():
                return accumulate(*args)

        trainer._accumulate = guarded  # type: ignore[method-assign]
    for tokens, labels in _batches(seed):
        losses.append(trainer.step(tokens[rows], labels[rows]))
    params = {(name, groups.coords.ep_rank): p.detach().clone() for name, p in rank_model.module.named_parameters()}
    return {
        "rank": dist.get_rank(),
        "losses": losses,
        "params": params,
        "collectives": recorder.collectives,
        "events": recorder.events,
        "overlapped": trainer.overlapped,
        "pairs": recorder.pairs,
        "weight_trace": weight_trace,
        "launched_in_backward": launched_in_backward,
    }


class _LaunchCounter:
    """A ``SyncObserver`` that notes, per step, how many buckets' reductions launched during the backward."""

    def __init__(self, optimizer, counts: list[int]):
        self.optimizer, self.counts = optimizer, counts

    def backward_ended(self) -> None:
        self.counts.append(self.optimizer.launched_buckets)

    def reduce_launched(self, bucket: int) -> None: ...
    def reductions_waited(self) -> None: ...
    def gather_launched(self, bucket: int) -> None: ...
    def updates_ended(self) -> None: ...
    def gathers_waited(self) -> None: ...


def _run(parallel: ParallelConfig, config: ModelConfig = CONFIG, guard: bool = False, trace_weights: bool = False):
    return run_ranks(_train_rank, parallel.world_size, parallel, SEED, config, guard, trace_weights, timeout=TIMEOUT)


def _losses(ranks: list[dict]) -> torch.Tensor:
    # Every rank holding the loss stage reports it; one per data-parallel rank.
    return torch.stack([torch.stack(r["losses"]) for r in ranks if r["losses"][0] is not None])


def _params(ranks: list[dict]) -> dict:
    merged: dict = {}
    for rank in ranks:
        for key, value in rank["params"].items():
            if key in merged:
                torch.testing.assert_close(value, merged[key], rtol=0, atol=0, msg=f"replicas of {key} differ")
            merged[key] = value
    return merged


def assert_same_training(got: list[dict], want: list[dict]) -> None:
    # Microbatches add the same terms in another order: fp32 rounding only.
    torch.testing.assert_close(_losses(got), _losses(want), rtol=1e-5, atol=0)
    got_params, want_params = _params(got), _params(want)
    assert set(got_params) == set(want_params)
    for key, value in want_params.items():
        torch.testing.assert_close(got_params[key], value, rtol=1e-5, atol=2e-6, msg=str(key))


def assert_same_collective_order(ranks: list[dict]) -> None:
    sequences: dict[tuple[int, ...], dict[int, list[str]]] = {}
    for rank in ranks:
        for group, ops in rank["collectives"].items():
            sequences.setdefault(group, {})[rank["rank"]] = ops
    for group, by_rank in sequences.items():
        first = next(iter(by_rank.values()))
        assert all(ops == first for ops in by_rank.values()), f"group {group}: members issue different sequences"


# ---- pipelines: zero bubble and DualPipeV against 1F1B -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, virtual_stages, microbatches",
    [("zbv", 2, 4), ("interleaved-zb", 2, 4), ("dualpipev", 2, 4)],
    ids=["zbv", "interleaved-zb", "dualpipev"],
)
def test_zero_bubble_schedules_train_like_1f1b(schedule, virtual_stages, microbatches):
    # The reference's experts are the per-expert loop under plain autograd: no split backward to share a bug with.
    reference = _run(ParallelConfig(pp=2, schedule="1f1b", microbatches=microbatches), config=LOOP_CONFIG)
    got = _run(
        ParallelConfig(
            pp=2, schedule=schedule, virtual_stages=virtual_stages, microbatches=microbatches, overlap="none"
        )
    )
    assert_same_training(got, reference)
    assert_same_collective_order(got)


@pytest.mark.slow
def test_zero_bubble_runs_each_expert_weight_gradient_once_in_a_w_action():
    # The experts' backward splits dX from dW: the schedule's I actions compute no expert dW, each W
    # action computes it once (a dW also run in I, or twice, would count 2m per step).
    parallel = ParallelConfig(pp=2, schedule="zbv", virtual_stages=2, microbatches=4)
    got = _run(parallel, trace_weights=True)
    for rank in got:
        trace = rank["weight_trace"]
        assert trace, "no expert weight gradient was traced"
        assert {action for action, _ in trace} == {"W"}, sorted(set(trace))
        names = {name for _, name in trace}
        for name in names:
            assert sum(1 for _, n in trace if n == name) == STEPS * parallel.microbatches, name


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipev", "interleaved1f1b"])
def test_overlapped_pipeline_with_expert_parallelism_trains_like_1f1b(schedule):
    # DualPipeV runs torch's own OVERLAP_F_B actions; interleaved 1F1B its paired plan, each steady-state
    # backward beside a forward of another microbatch (moe_engine.parallel.paired_plan).
    base = dict(pp=2, dp=2, ep=2, microbatches=4)
    reference = _run(ParallelConfig(**base, schedule="1f1b"))
    parallel = ParallelConfig(**base, schedule=schedule, virtual_stages=2)
    assert parallel.resolved_overlap is ExpertOverlap.MICROBATCHES
    got = _run(parallel)
    assert_same_training(got, reference)
    assert_same_collective_order(got)
    if schedule == "interleaved1f1b":
        # The cool-down's weight backwards hand their gradients to the buffer as they run, as 1F1B's
        # full backwards do: their buckets reduce during the backward, not after it.
        launched = {rank["rank"]: rank["launched_in_backward"] for rank in got}
        assert launched == {rank["rank"]: rank["launched_in_backward"] for rank in reference}, launched
        assert all(count > 0 for counts in launched.values() for count in counts), launched
    for rank in got:
        kinds = {tuple(sorted(pair)) for pair in rank["pairs"]}
        if schedule == "dualpipev":
            assert kinds == {("B", "F")}, kinds
        else:
            # The cool-down's weight backwards beside the backwards after them, inside their all-to-alls.
            assert {("B", "F"), ("I", "W")} <= kinds <= {("B", "F"), ("I", "W"), ("B", "W")}, kinds
            assert _slices_in_flight(rank["events"]) >= sum(pair[1] == "W" for pair in rank["pairs"]) > 0
        assert overlap_violations(rank["events"]) == []


def _slices_in_flight(events: list[tuple]) -> int:
    """Weight-backward slices run while an expert all-to-all was in flight (started, not waited for)."""
    in_flight: set = set()
    count = 0
    for kind, _, *exchange in events:
        if kind == "start":
            in_flight.add(tuple(exchange))
        elif kind == "wait":
            in_flight.discard(tuple(exchange))
        elif kind == "slice":
            count += bool(in_flight)
    return count


# ---- the overlapped data-parallel step (pp = 1) ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["no-sync", "sync"])
def test_overlapped_data_parallel_step_trains_like_the_plain_step(dispatch):
    base = dict(dp=2, ep=2, microbatches=2, dispatch=dispatch)
    reference = _run(ParallelConfig(**base, overlap="none"))
    parallel = ParallelConfig(**base)
    assert parallel.resolved_overlap is ExpertOverlap.MICROBATCHES
    got = _run(parallel)
    assert all(r["overlapped"] for r in got) and not any(r["overlapped"] for r in reference)
    assert_same_training(got, reference)
    assert_same_collective_order(got)
    for rank in got:
        assert ("run", 1) in rank["events"], "the second microbatch never ran beside the first"
        assert overlap_violations(rank["events"]) == []


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["no-sync", "sync"])
def test_overlapped_step_with_rows_per_node_trains_like_the_plain_step(dispatch):
    # Four ranks as two nodes of two: each dispatch and combine is a chain of two levels.
    base = dict(dp=4, ep=4, microbatches=2, ranks_per_node=2, dispatch=dispatch, capacity_factor=4.0)
    reference = _run(ParallelConfig(**base, overlap="none"))
    got = _run(ParallelConfig(**base))
    assert ParallelConfig(**base).resolved_dispatch_rows.value == "per-node"
    assert_same_training(got, reference)
    assert_same_collective_order(got)
    for rank in got:
        assert ("run", 1) in rank["events"], "the second microbatch never ran beside the first"
        assert overlap_violations(rank["events"]) == []


@pytest.mark.slow
def test_overlapped_data_parallel_step_with_chunks_and_zero1_has_no_host_sync():
    base = dict(dp=2, ep=2, microbatches=4, a2a_chunks=2, optimizer_sharding="zero1")
    reference = _run(ParallelConfig(**base, overlap="chunks"))
    got = _run(ParallelConfig(**base, overlap="microbatches"), guard=True)
    assert_same_training(got, reference)
    assert_same_collective_order(got)
    for rank in got:
        assert overlap_violations(rank["events"]) == []
