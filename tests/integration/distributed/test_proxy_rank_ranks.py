"""The proxy rank against the real ranks it stands for, on gloo ranks."""

from collections import Counter

import pytest
import torch
from distributed_harness import run_ranks
from proxy_rank_world import CONFIG, fake_rank
from tolerances import assert_close_to_scale, tolerance

from bench.run.collective_log import CollectiveRecorder
from bench.run.proxy.rank.build import build_proxy_rank
from bench.run.proxy.rank.peers import PeerTraffic
from moe_engine.config import ParallelConfig
from moe_engine.moe.dispatch import AllToAllDispatcher
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

SEQUENCES = 8


def _batch(seed: int, dp_rank: int, dp: int):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (SEQUENCES, CONFIG.seq_len + 1), generator=generator)
    share = SEQUENCES // dp
    tokens = tokens[dp_rank * share : (dp_rank + 1) * share]
    return tokens[:, :-1], tokens[:, 1:]


# ---- the step: real gloo ranks vs proxies ---------------------------------------------------------


class _Capture:
    """Per MoE layer: received counts and dispatched rows, and the local experts' outputs."""

    def __init__(self, rank_model):
        self.counts, self.rows, self.outputs = {}, {}, {}
        for index, layer in enumerate(rank_model.moe_layers()):
            self.outputs[index] = []
            layer.experts.register_forward_hook(lambda m, a, out, i=index: self.outputs[i].append(out.detach().clone()))
            dispatcher = layer.dispatcher
            if isinstance(dispatcher, AllToAllDispatcher) and type(dispatcher) is AllToAllDispatcher:
                self.counts[index], self.rows[index] = [], []
                self._wrap(dispatcher, index)

    def _wrap(self, dispatcher, index):
        exchange_counts, exchange_rows = dispatcher.exchange_counts, dispatcher.exchange_rows

        def counts(send_counts_SL, expert_TK):
            out = exchange_counts(send_counts_SL, expert_TK)
            self.counts[index].append(out.clone())
            return out

        def rows(send_RD, recv_splits, send_splits, combine):
            out = exchange_rows(send_RD, recv_splits, send_splits, combine)
            if not combine:
                self.rows[index].append(out.detach().clone())
            return out

        dispatcher.exchange_counts, dispatcher.exchange_rows = counts, rows


def _real_rank(layout: dict, steps: int):
    parallel = ParallelConfig.from_dict(layout)
    groups = build_process_groups(Layout(parallel))
    rank_model = build_rank_model(CONFIG, parallel, groups, torch.device("cpu"), seed=0)
    trainer = ParallelTrainer(rank_model, parallel, groups)
    tokens, labels = _batch(1, groups.coords.dp_rank, parallel.dp)
    for _ in range(steps - 1):
        # Earlier steps let the pipeline infer its shapes (metadata messages the proxy does not send).
        trainer.step(tokens, labels)
    state = {n: t.detach().clone() for n, t in rank_model.module.state_dict().items()}
    capture = _Capture(rank_model)
    with CollectiveRecorder() as recorder:
        trainer.step(tokens, labels)
    calls = [(c.op, c.ranks, c.nbytes) for c in recorder.calls]
    return {"state": state, "counts": capture.counts, "rows": capture.rows, "outputs": capture.outputs, "calls": calls}


class _Replay(PeerTraffic):
    """The counts and dispatched rows the real rank received, in call order."""

    def __init__(self, counts, rows):
        self.counts_left, self.rows_left = list(counts), list(rows)

    def counts(self, dispatcher, send_counts_SL, expert_TK):
        return self.counts_left.pop(0)

    def rows(self, send_RD, num_rows, combine):
        if combine:
            return super().rows(send_RD, num_rows, combine)
        rows = self.rows_left.pop(0)
        assert rows.shape[0] == num_rows
        return rows


def _proxy_rank(layout: dict, rank: int, steps: int, real: dict | None, replay: bool):
    parallel = ParallelConfig.from_dict(layout)
    with fake_rank(parallel, rank) as groups:
        rank_model = build_proxy_rank(CONFIG, parallel, groups, torch.device("cpu"), seed=0)
        trainer = ParallelTrainer(rank_model, parallel, groups)
        tokens, labels = _batch(1, groups.coords.dp_rank, parallel.dp)
        for _ in range(steps - 1):
            trainer.step(tokens, labels)
        if real is not None:
            # The weights the real rank had at the compared step.
            rank_model.module.load_state_dict(real["state"])
        layers = rank_model.moe_layers()
        if replay:
            for index, layer in enumerate(layers):
                layer.dispatcher.peers = _Replay(real["counts"][index], real["rows"][index])
        counts = {i: [] for i in range(len(layers))}
        for index, layer in enumerate(layers):
            peers = layer.dispatcher.peers if parallel.ep > 1 else None
            if peers is not None:
                original = peers.counts

                def record(dispatcher, send, expert_TK, original=original, index=index):
                    out = original(dispatcher, send, expert_TK)
                    counts[index].append(out.clone())
                    return out

                peers.counts = record
        capture = _Capture(rank_model)
        with CollectiveRecorder() as recorder:
            trainer.step(tokens, labels)
    return {"counts": counts, "outputs": capture.outputs, "calls": [(c.op, c.ranks, c.nbytes) for c in recorder.calls]}


# A proxy rank replays rows per (token, expert) (``ProxyDispatcher``): the real ranks send the same rows.
LAYOUTS = {
    "dp2-ep2-nosync-zero1": dict(
        dp=2, ep=2, dispatch="no-sync", capacity_factor=1.0, optimizer_sharding="zero1", dispatch_rows="per-expert"
    ),
    "dp2-ep2-sync": dict(dp=2, ep=2, dispatch="sync", dispatch_rows="per-expert"),
    # Each direction's exchange cut in two: the proxy issues the real rank's chunked all-to-alls.
    "dp2-ep2-sync-chunks2": dict(dp=2, ep=2, dispatch="sync", dispatch_rows="per-expert", a2a_chunks=2),
    "pp2-1f1b": dict(dp=1, pp=2, schedule="1f1b", microbatches=2),
}


@pytest.fixture(scope="module")
def real_runs():
    """Each layout's real 2-rank run, once for the module's tests."""
    return {name: run_ranks(_real_rank, 2, layout, 2, timeout=180) for name, layout in LAYOUTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2-ep2-nosync-zero1", "dp2-ep2-sync"])
@pytest.mark.parametrize("rank", [0, 1])
def test_proxy_local_experts_match_the_real_rank(real_runs, name, rank):
    real = real_runs[name][rank]
    # Simulated peers: the counts each peer sends are exactly what the real peers sent.
    simulated = _proxy_rank(LAYOUTS[name], rank, 2, None, replay=False)
    for index, counts in real["counts"].items():
        assert len(simulated["counts"][index]) == len(counts)
        for got, want in zip(simulated["counts"][index], counts):
            assert torch.equal(got, want), f"layer {index}"
    # Given the tokens the real rank received, the proxy's local experts compute the same outputs.
    replayed = _proxy_rank(LAYOUTS[name], rank, 2, real, replay=True)
    for index, outputs in real["outputs"].items():
        for got, want, counts in zip(replayed["outputs"][index], outputs, real["counts"][index], strict=True):
            # Rows past the received ones are capacity padding, left undefined by the grouped GEMM.
            rows = int(counts.sum())
            assert rows > 0 and got.shape == want.shape
            # The experts' two GEMMs (over d_model, then expert_hidden) in another process, perhaps blocked
            # otherwise for another row count.
            tol = tolerance(torch.float32, max(CONFIG.d_model, CONFIG.moe.expert_hidden), depth=2)
            assert_close_to_scale(got[:rows], want[:rows], tol)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("rank", [0, 1])
def test_proxy_issues_the_real_collectives(real_runs, name, rank):
    real = real_runs[name][rank]["calls"]
    proxy = _proxy_rank(LAYOUTS[name], rank, 2, None, replay=False)["calls"]
    assert real, "the real step issued no collectives"
    # Same collectives with the same groups and byte sizes; pipelining orders its messages its own way.
    assert Counter(proxy) == Counter(real)
