import itertools

import pytest
import torch.distributed as dist

from distributed_harness import RankFailure, run_ranks
from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout, stage_layers


@pytest.mark.parametrize("dp,ep,pp", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 2, 1), (4, 2, 3), (8, 4, 2)])
def test_groups_partition_the_world_and_agree_with_coordinates(dp, ep, pp):
    layout = Layout(ParallelConfig(dp=dp, ep=ep, pp=pp))
    world = range(dp * pp)
    sizes = {"dp": dp, "ep": ep, "edp": dp // ep, "pp": pp}
    for kind, size in sizes.items():
        groups = layout.groups(kind)
        assert sorted(itertools.chain.from_iterable(groups)) == list(world), kind
        assert all(len(g) == size for g in groups), kind
    for rank in world:
        c = layout.coords(rank)
        assert layout.rank_of(c.pp_rank, c.edp_rank, c.ep_rank) == rank
        dp_group = next(g for g in layout.groups("dp") if rank in g)
        assert dp_group.index(rank) == c.dp_rank
        ep_group = next(g for g in layout.groups("ep") if rank in g)
        assert ep_group.index(rank) == c.ep_rank
        # An expert-data-parallel group holds the same experts: same ep_rank and pipeline stage.
        edp_group = next(g for g in layout.groups("edp") if rank in g)
        assert {(layout.coords(r).ep_rank, layout.coords(r).pp_rank) for r in edp_group} == {(c.ep_rank, c.pp_rank)}
        pp_group = next(g for g in layout.groups("pp") if rank in g)
        assert [layout.coords(r).pp_rank for r in pp_group] == list(range(pp))


def test_ep_groups_are_adjacent_ranks():
    layout = Layout(ParallelConfig(dp=8, ep=4, pp=2))
    assert layout.groups("ep")[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("edp")[0] == [0, 4]


def test_local_experts_tile_the_experts():
    layout = Layout(ParallelConfig(dp=4, ep=4))
    held = [list(layout.local_experts(r, 16)) for r in range(4)]
    assert sum(held, []) == list(range(16))


def test_stages_cover_every_block_once():
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_layers(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    layout = Layout(ParallelConfig(dp=1, pp=2, virtual_stages=2, schedule="interleaved1f1b"))
    assert layout.stage_indices(0) == [0, 2] and layout.stage_indices(1) == [1, 3]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dp=3, ep=2), "parallel.ep: ep=2 does not divide dp=3"),
        (dict(dp=2, virtual_stages=2), "parallel.virtual_stages: more than one stage per rank needs schedule interleaved1f1b"),
        (dict(dp=2, dp_mode="fsdp", optimizer_sharding="zero1"), "parallel.optimizer_sharding: fsdp already shards"),
        (dict(dispatch="maybe"), "parallel.dispatch: 'maybe' is not one of sync, no-sync"),
        (dict(capacity_factor=0), "parallel.capacity_factor: must be > 0"),
    ],
)
def test_impossible_layouts_are_rejected_with_the_field(kwargs, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        ParallelConfig(**kwargs)


def test_fsdp_with_expert_parallelism_is_planned_but_not_executed():
    config = ParallelConfig(dp=4, ep=2, dp_mode="fsdp")
    with pytest.raises(ValueError, match="parallel.dp_mode: the engine's fsdp mode shards experts over dp"):
        config.validate_executable()


def test_layout_checked_against_the_model():
    model = ModelConfig(n_layers=2, moe=MoEConfig(num_experts=6, top_k=2))
    with pytest.raises(ValueError, match="parallel.ep: ep=4 does not divide model.moe.num_experts=6"):
        ParallelConfig(dp=4, ep=4).validate(model)
    with pytest.raises(ValueError, match=r"parallel.pp: pp \* virtual_stages = 4 exceeds model.n_layers=2"):
        ParallelConfig(pp=4).validate(model)
    with pytest.raises(ValueError, match="parallel.world_size: 3 != dp \\* pp = 4"):
        ParallelConfig.from_dict({"dp": 2, "pp": 2, "world_size": 3})


def _group_members(dp, ep, pp):
    groups = build_process_groups(Layout(ParallelConfig(dp=dp, ep=ep, pp=pp)))
    return {kind: dist.get_process_group_ranks(getattr(groups, kind)) for kind in ("dp", "ep", "edp", "pp")}


def test_process_groups_match_the_layout_on_real_ranks():
    layout = Layout(ParallelConfig(dp=2, ep=2, pp=2))
    members = run_ranks(_group_members, 4, 2, 2, 2, timeout=90)
    for rank, got in enumerate(members):
        for kind, ranks in got.items():
            assert ranks == next(g for g in layout.groups(kind) if rank in g)


def _wrong_world():
    build_process_groups(Layout(ParallelConfig(dp=4)))


def test_world_size_mismatch_is_a_clear_error():
    with pytest.raises(RankFailure, match=r"the layout needs 4 ranks \(dp \* pp\) but the process group has 2"):
        run_ranks(_wrong_world, 2, timeout=60)
