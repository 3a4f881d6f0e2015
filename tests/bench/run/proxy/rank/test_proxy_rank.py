"""A proxy rank holds exactly its share, and runs what the real rank runs.

The real runs are gloo ranks in fresh processes (``distributed_harness``); the proxies join a fake
world in this process, one rank at a time.
"""

import contextlib
import dataclasses
from collections import Counter

import pytest
import torch
from distributed_harness import run_ranks
from tolerances import assert_close_to_scale, tolerance

from bench.run.collective_log import CollectiveRecorder
from bench.run.proxy.rank.build import build_proxy_rank
from bench.run.proxy.rank.peers import PeerTraffic, ProxyDispatcher, ProxyDispatchSpec, SimulatedPeers
from bench.run.proxy.rank.world import join_fake_world, leave_fake_world
from moe_engine import build_model
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.moe.dispatch import AllToAllDispatcher
from moe_engine.parallel.data_parallel import ParamFamily
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer, build_rank_model

CONFIG = ModelConfig(
    vocab_size=96,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    dtype="fp32",
    moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=24, shared_expert_hidden=16, routing="random"),
)
SEQUENCES = 8
EXPERT_PARAMS = ("experts.gate_up", "experts.down")


@contextlib.contextmanager
def fake_rank(parallel: ParallelConfig, rank: int):
    join_fake_world(rank, parallel.world_size)
    try:
        yield build_process_groups(Layout(parallel))
    finally:
        leave_fake_world()


def _batch(seed: int, dp_rank: int, dp: int):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (SEQUENCES, CONFIG.seq_len + 1), generator=generator)
    share = SEQUENCES // dp
    tokens = tokens[dp_rank * share : (dp_rank + 1) * share]
    return tokens[:, :-1], tokens[:, 1:]


# ---- the shard ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, ep=2),
        dict(dp=4, ep=2, pp=2, schedule="1f1b", microbatches=2, optimizer_sharding="zero1"),
        dict(dp=4, ep=4, pp=2, schedule="gpipe", microbatches=2),
    ],
    ids=["dp2-ep2", "dp4-ep2-pp2-zero1", "dp4-ep4-pp2"],
)
def test_proxy_shards_partition_the_model(layout):
    parallel = ParallelConfig.from_dict(layout)
    full = {n: tuple(p.shape) for n, p in build_model(CONFIG, "meta").named_parameters()}
    num_experts = CONFIG.moe.num_experts
    holders: dict[str, list] = {name: [] for name in full}
    dense_state: dict[int, list[int]] = {}
    for rank in range(parallel.world_size):
        with fake_rank(parallel, rank) as groups:
            rank_model = build_proxy_rank(CONFIG, parallel, groups, torch.device("cpu"), seed=0)
            coords = groups.coords
            for name, param in rank_model.module.named_parameters():
                assert param.device.type == "cpu" and name in full, name
                if name.endswith(EXPERT_PARAMS):
                    experts = Layout(parallel).local_experts(coords.ep_rank, num_experts)
                    assert tuple(param.shape) == (len(experts), *full[name][1:]), name
                    holders[name].append((coords.pp_rank, coords.edp_rank, tuple(experts)))
                else:
                    assert tuple(param.shape) == full[name], name
                    holders[name].append((coords.pp_rank, coords.dp_rank, None))
            trainer = ParallelTrainer(rank_model, parallel, groups)
            dense_state.setdefault(coords.pp_rank, []).append(trainer.optimizer.state_bytes(ParamFamily.DENSE))

    for name, held in holders.items():
        stages = {pp for pp, _, _ in held}
        assert len(stages) == 1, f"{name} is held by stages {stages}"
        if name.endswith(EXPERT_PARAMS):
            # Each replica (edp rank) holds every expert exactly once, split over its ep ranks.
            for edp in range(parallel.edp):
                experts = [e for _, r, block in held if r == edp for e in block]
                assert sorted(experts) == list(range(num_experts)), name
        else:
            assert sorted(r for _, r, _ in held) == list(range(parallel.dp)), name

    # The optimizer state of a stage's dense parameters is split over its dp ranks (ZeRO-1) or replicated.
    for sizes in dense_state.values():
        if parallel.optimizer_sharding.value == "zero1":
            assert max(sizes) - min(sizes) <= 64 and len(set(sizes)) <= 2
        else:
            assert len(set(sizes)) == 1


def test_proxy_build_allocates_only_the_share():
    parallel = ParallelConfig.from_dict(dict(dp=4, ep=4, pp=2, schedule="1f1b", microbatches=2))
    with fake_rank(parallel, 5) as groups:
        rank_model = build_proxy_rank(CONFIG, parallel, groups, torch.device("cpu"), seed=0)
        held = sum(p.numel() for p in rank_model.module.parameters())
        rope = rank_model.pipeline.module.rope
    full = build_model(CONFIG, "meta")
    stage_blocks = [b for i, b in enumerate(full.blocks) if i >= 2]
    expected = sum(p.numel() for b in stage_blocks for n, p in b.named_parameters() if not n.endswith(EXPERT_PARAMS))
    expected += sum(p.numel() for b in stage_blocks for n, p in b.named_parameters() if n.endswith(EXPERT_PARAMS)) // 4
    expected += sum(p.numel() for p in (*full.norm.parameters(), *full.lm_head.parameters()))
    assert held == expected
    reference = build_model(CONFIG).rope
    torch.testing.assert_close(rope.cos_SH, reference.cos_SH, rtol=0, atol=0)
    torch.testing.assert_close(rope.sin_SH, reference.sin_SH, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_proxy_dispatchers_are_built_from_the_layout(fused):
    # Rows per node in the layout: the proxy still sends them per expert (its peers replay per expert).
    parallel = ParallelConfig.from_dict(
        dict(dp=4, ep=4, dispatch="sync", capacity_factor=1.5, a2a_chunks=3, dispatch_rows="per-node", ranks_per_node=2)
    )
    config = dataclasses.replace(CONFIG, fused_kernels=fused)
    with fake_rank(parallel, 2) as groups:
        rank_model = build_proxy_rank(config, parallel, groups, torch.device("cpu"), seed=0)
        layers = rank_model.moe_layers()
        assert len(layers) == CONFIG.n_layers
        for index, layer in enumerate(layers):
            d = layer.dispatcher
            assert type(d) is ProxyDispatcher and d.group is groups.ep and d.ep == 4
            assert (d.kind.value, d.capacity_factor, d.chunks, d.fused_kernels) == ("sync", 1.5, 3, fused)
            assert layer.experts.global_experts == range(4, 6)
            assert isinstance(d.peers, SimulatedPeers)
            # By hand: ep rank s (dp rank s) routes with seed 0 + 7919 s, the engine's per-dp-rank stride.
            seeds = [None if r is None else r.config.routing_seed for r in d.peers.routers]
            assert seeds == [0, 7919, None, 3 * 7919]
            assert all(r.layer_idx == index for r in d.peers.routers if r is not None)
            assert d.routing_streams() == [r for r in d.peers.routers if r is not None]


def test_a_proxy_spec_refuses_what_a_proxy_cannot_send():
    parallel = ParallelConfig.from_dict(dict(dp=2, ep=2))
    with fake_rank(parallel, 1) as groups:
        ok = dict(group=groups.ep, ep_rank=1, ep=2, peer_seeds=(7, None))
        assert isinstance(ProxyDispatchSpec(**ok).build(CONFIG.moe, 32, 1, False), ProxyDispatcher)
        with pytest.raises(ValueError, match="per expert"):
            ProxyDispatchSpec(**ok, rows="per-rank")
        with pytest.raises(ValueError, match="None at"):
            ProxyDispatchSpec(**{**ok, "peer_seeds": (None, 7)})
        with pytest.raises(ValueError, match="one seed per ep rank"):
            ProxyDispatchSpec(**{**ok, "peer_seeds": (None,)})
    with pytest.raises(ValueError, match="needs an expert-parallel group"):
        ProxyDispatchSpec(peer_seeds=(None,))


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


class _FewerFromPeerZero(PeerTraffic):
    """Source 0 sends nothing: its whole capacity block arrives as padding."""

    def counts(self, dispatcher, send_counts_SL, expert_TK):
        counts = dispatcher.send_counts(expert_TK, send_counts_SL.shape[1]).clone()
        counts[0] = 0
        return counts


def test_padding_gradients_never_reach_the_sent_rows():
    # The experts leave padding rows' gradients undefined (NaN here); a real peer's padding gradient
    # lands in an empty slot, so the proxy's fabricated gradient must not carry it to a real row.
    parallel = ParallelConfig.from_dict(dict(dp=2, ep=2, dispatch="no-sync", capacity_factor=1.0))
    with fake_rank(parallel, 1) as groups:
        dispatcher = ProxyDispatcher(groups.ep, parallel.dispatch, 1.0, 1, False, _FewerFromPeerZero())
        expert_TK = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]])
        send_counts_SL = dispatcher.send_counts(expert_TK, 2)
        recv_counts_SL = dispatcher.exchange_counts(send_counts_SL, expert_TK)
        assert recv_counts_SL[0].sum() == 0 and torch.equal(recv_counts_SL[1], send_counts_SL[1])
        send_RD = torch.randn(8, 3, requires_grad=True)
        recv_RD = dispatcher.exchange_rows(send_RD, None, None, combine=False)
        grad_RD = torch.randn(8, 3)
        grad_RD[:4] = float("nan")  # source 0's block: all padding
        recv_RD.backward(grad_RD)
    expected = grad_RD.clone()
    expected[:4] = 0
    assert torch.equal(send_RD.grad, expected)
