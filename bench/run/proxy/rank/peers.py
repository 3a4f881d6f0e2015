"""Stand-ins for the other ranks of a proxy rank's expert-parallel group.

A proxy rank runs ``AllToAllDispatcher``'s code with one change: after each exchange, whose
collective is issued on the fake world (and recorded) but moves nothing, the received counts and
rows are supplied by a ``PeerTraffic``:

- counts: ``SimulatedPeers`` replays each peer's router. Random, balanced and skewed routing draw
  from a generator seeded per data-parallel rank and layer, so the proxy computes exactly the
  routes, capacity drops and counts the real peers would send it. Learned routing depends on the
  peers' activations, which do not exist here; each peer is then assumed to route like this rank.
- rows: the values of the tokens peers would send are not known either; the proxy reuses its own
  outgoing rows (repeated or cut to the received size). Expert GEMMs see the right shapes and
  realistic magnitudes. Gradients coming back are treated the same way.

Work done only to fabricate traffic runs inside ``fabrication()``, so a phase timer can leave it out.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from moe_engine.config import DispatchRows, MoEConfig, RoutingMode
from moe_engine.moe.dispatch import AllToAllDispatcher, all_to_all_rows
from moe_engine.moe.dispatch_spec import DispatchSpec
from moe_engine.moe.router import Router


def repeat_rows(rows_RD: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``num_rows`` rows cycling through ``rows_RD`` (zeros when it has none)."""
    if rows_RD.shape[0] == 0:
        return rows_RD.new_zeros(num_rows, *rows_RD.shape[1:])
    if rows_RD.shape[0] == num_rows:
        return rows_RD.clone()
    index = torch.arange(num_rows, device=rows_RD.device) % rows_RD.shape[0]
    return rows_RD.index_select(0, index)


class PeerTraffic:
    """What the ep group sends this rank; the default reuses this rank's own traffic."""

    def counts(
        self, dispatcher: AllToAllDispatcher, send_counts_SL: torch.Tensor, expert_TK: torch.Tensor
    ) -> torch.Tensor:
        """(ep, L): rows each source rank sends this rank's local experts (here: what this rank sends)."""
        return send_counts_SL.clone()

    def rows(self, send_RD: torch.Tensor, num_rows: int, combine: bool) -> torch.Tensor:
        """The ``num_rows`` received rows, given the rows this rank sent in the same exchange."""
        return repeat_rows(send_RD, num_rows)


class SimulatedPeers(PeerTraffic):
    """Peers' counts from replicas of their routers (see the module docstring)."""

    def __init__(self, moe: MoEConfig, layer_idx: int, peer_routing_seeds: list[int | None], d_model: int):
        """``peer_routing_seeds[s]`` is ep rank s's routing seed, None for this rank itself."""
        self.routers: list[Router | None] = []
        for seed in peer_routing_seeds:
            if seed is None:
                self.routers.append(None)
                continue
            # Only the selection stream is used: the replica's weights stay on the meta device.
            config = dataclasses.replace(moe, routing_seed=seed)
            with torch.device("meta"):
                self.routers.append(Router(d_model, config, layer_idx))
        self.learned = moe.routing is RoutingMode.LEARNED

    def counts(self, dispatcher, send_counts_SL, expert_TK):
        me = self.routers.index(None)
        if self.learned:
            # Every peer routes like this rank: what it sends itself, from each source.
            return send_counts_SL[me].expand_as(send_counts_SL).clone()
        num_tokens, num_local = expert_TK.shape[0], send_counts_SL.shape[1]
        rows = []
        for router in self.routers:
            if router is None:
                rows.append(send_counts_SL[me])
                continue
            scores_TE = torch.empty(num_tokens, router.config.num_experts, device=expert_TK.device)
            rows.append(dispatcher.send_counts(router.select_experts(scores_TE), num_local)[me])
        return torch.stack(rows)


class _PeerExchange(torch.autograd.Function):
    """The all-to-all as issued on the fake world, with received rows (and gradients) fabricated.

    ``real_R`` marks the received rows that hold tokens (the rest is capacity padding, whose
    gradients the experts leave undefined); only real rows' gradients are reused as the gradients
    peers send back, as a real peer's padding gradients land in empty slots and are ignored.
    """

    @staticmethod
    def forward(ctx, send_RD, dispatcher, recv_splits, send_splits, combine, real_R):
        ctx.dispatcher, ctx.splits, ctx.real_R = dispatcher, (recv_splits, send_splits), real_R
        recv_RD = all_to_all_rows(send_RD, recv_splits, send_splits, dispatcher.group)
        with dispatcher.fabrication():
            recv_RD.copy_(dispatcher.peers.rows(send_RD, recv_RD.shape[0], combine))
        return recv_RD

    @staticmethod
    def backward(ctx, grad_recv_RD):
        recv_splits, send_splits = ctx.splits
        dispatcher = ctx.dispatcher
        grad_send_RD = all_to_all_rows(grad_recv_RD, send_splits, recv_splits, dispatcher.group)
        with dispatcher.fabrication():
            if ctx.real_R is not None:
                grad_recv_RD = torch.where(ctx.real_R.unsqueeze(1), grad_recv_RD, 0)
            grad_send_RD.copy_(repeat_rows(grad_recv_RD, grad_send_RD.shape[0]))
        return grad_send_RD, None, None, None, None, None


class ProxyDispatcher(AllToAllDispatcher):
    """``AllToAllDispatcher`` on a fake world, with ``peers`` supplying what the other ranks send."""

    def __init__(
        self,
        group,
        kind,
        capacity_factor: float,
        chunks: int,
        fused_kernels: bool,
        peers: PeerTraffic,
        fabrication: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ):
        super().__init__(group, kind, capacity_factor, chunks, fused_kernels)
        self.peers = peers
        self.fabrication = fabrication

    def routing_streams(self):
        return [router for router in getattr(self.peers, "routers", []) if router is not None]

    def exchange_counts(self, send_counts_SL, expert_TK):
        recv_counts_SL = super().exchange_counts(send_counts_SL, expert_TK)
        with self.fabrication():
            recv_counts_SL.copy_(self.peers.counts(self, send_counts_SL, expert_TK))
        self._recv_counts_SL = recv_counts_SL
        return recv_counts_SL

    def exchange_rows(self, send_RD, recv_splits, send_splits, combine):
        real_R = None
        if not combine and recv_splits is None:
            # No-sync: source s fills the first (its count) of its C slots; the rest is padding.
            slot_capacity = send_RD.shape[0] // self.ep
            received_S = self._recv_counts_SL.sum(dim=1, keepdim=True)
            real_R = (torch.arange(slot_capacity, device=send_RD.device) < received_S).flatten()
        return _PeerExchange.apply(send_RD, self, recv_splits, send_splits, combine, real_R)


@dataclasses.dataclass(frozen=True)
class ProxyDispatchSpec(DispatchSpec):
    """A proxy rank's dispatch: every MoE layer builds a ``ProxyDispatcher`` whose ``SimulatedPeers``
    replay the other ep ranks' routers. Rows are always per (token, expert): the proxy fabricates
    what each peer sends per expert, so ``rows`` must stay per-expert."""

    peer_seeds: tuple[int | None, ...] = ()
    """Routing seed of each rank of the ep group, None at this rank's own index (``ep_rank``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.local:
            raise ValueError("a proxy dispatch needs an expert-parallel group")
        if self.rows is not DispatchRows.PER_EXPERT:
            raise ValueError(f"a proxy rank sends rows per expert, not {self.rows.value}")
        if len(self.peer_seeds) != self.ep or [s is None for s in self.peer_seeds].count(True) != 1:
            raise ValueError(f"peer_seeds needs one seed per ep rank and None at {self.ep_rank}: {self.peer_seeds}")
        if self.peer_seeds[self.ep_rank] is not None:
            raise ValueError(f"peer_seeds needs None at this rank's index {self.ep_rank}: {self.peer_seeds}")

    def build(self, moe: MoEConfig, d_model: int, layer_idx: int, fused_kernels: bool) -> ProxyDispatcher:
        peers = SimulatedPeers(moe, layer_idx, list(self.peer_seeds), d_model)
        return ProxyDispatcher(self.group, self.kind, self.capacity_factor, self.a2a_chunks, fused_kernels, peers)
