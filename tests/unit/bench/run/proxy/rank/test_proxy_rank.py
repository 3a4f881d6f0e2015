"""A proxy rank holds exactly its share, and runs what the real rank runs.

The proxies join a fake world in this process, one rank at a time; the comparisons with the real
ranks, gloo ranks in fresh processes, are tests/integration/distributed/test_proxy_rank_ranks.py.
"""

import dataclasses

import pytest
import torch
from proxy_rank_world import CONFIG, fake_rank

from bench.run.proxy.rank.build import build_proxy_rank
from bench.run.proxy.rank.peers import PeerTraffic, ProxyDispatcher, ProxyDispatchSpec, SimulatedPeers
from moe_engine import build_model
from moe_engine.config import ParallelConfig
from moe_engine.parallel.data_parallel import ParamFamily
from moe_engine.parallel.layout import Layout
from moe_engine.parallel.trainer import ParallelTrainer

EXPERT_PARAMS = ("experts.gate_up", "experts.down")


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


# ---- the proxy's exchange: padding ----------------------------------------------------------------


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
