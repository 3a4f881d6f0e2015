import itertools
import re

import pytest
import torch.distributed as dist

from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
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
    assert list(itertools.chain.from_iterable(held)) == list(range(16))


def test_stages_cover_every_block_once():
    assert stage_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert stage_layers(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    layout = Layout(ParallelConfig(dp=1, pp=2, virtual_stages=2, schedule="interleaved1f1b"))
    assert layout.stage_indices(0) == [0, 2] and layout.stage_indices(1) == [1, 3]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(dp=3, ep=2), "parallel.ep: ep=2 does not divide dp=3"),
        (
            dict(dp=2, virtual_stages=2),
            "parallel.virtual_stages: more than one stage per rank needs schedule interleaved1f1b",
        ),
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
    with pytest.raises(ValueError, match=re.escape("parallel.dp_mode: the engine's fsdp mode shards experts over dp")):
        config.validate_executable()


def test_layout_checked_against_the_model():
    model = ModelConfig(n_layers=2, moe=MoEConfig(num_experts=6, top_k=2))
    with pytest.raises(ValueError, match=re.escape("parallel.ep: ep=4 does not divide model.moe.num_experts=6")):
        ParallelConfig(dp=4, ep=4).validate(model)
    with pytest.raises(ValueError, match=r"parallel.pp: pp \* virtual_stages = 4 exceeds model.n_layers=2"):
        ParallelConfig(pp=4).validate(model)
    with pytest.raises(ValueError, match=re.escape("parallel.world_size: 3 != dp * pp = 4")):
        ParallelConfig.from_dict({"dp": 2, "pp": 2, "world_size": 3})


# ---- pipeline layouts: what torch.distributed.pipelining's schedules accept ------------------


def test_microbatches_default_to_one_per_stage():
    assert ParallelConfig().microbatches == 1
    assert ParallelConfig(pp=4).microbatches == 4
    assert ParallelConfig(pp=2, schedule="interleaved1f1b", virtual_stages=2).microbatches == 2
    assert ParallelConfig(pp=3, microbatches=6).microbatches == 6
    for schedule in ("gpipe", "1f1b", "interleaved1f1b"):
        ParallelConfig(pp=4, schedule=schedule).validate_executable()  # the default always runs


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(pp=2, schedule="1f1b", microbatches=1),
            "parallel.microbatches: schedule 1f1b needs at least one microbatch per stage, pp=2; got 1",
        ),
        (
            dict(pp=4, schedule="1f1b", microbatches=3),
            "parallel.microbatches: schedule 1f1b needs at least one microbatch per stage, pp=4; got 3",
        ),
        (
            dict(pp=4, schedule="interleaved1f1b", virtual_stages=2, microbatches=9),
            "parallel.microbatches: schedule interleaved1f1b runs microbatches in rounds of about pp=4: 9 microbatches "
            "make 2 rounds and do not split into them (the nearest counts that do: 8, 10)",
        ),
        (
            dict(pp=2, schedule="interleaved1f1b", microbatches=5),
            "parallel.microbatches: schedule interleaved1f1b runs microbatches in rounds of about pp=2: 5 microbatches "
            "make 2 rounds",
        ),
    ],
)
def test_schedules_refuse_what_torch_refuses_before_any_rank_starts(kwargs, message):
    config = ParallelConfig(**kwargs)  # the plan prices it; the engine does not run it
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        config.validate_executable()


def test_batch_must_split_over_dp_and_microbatches():
    ParallelConfig(dp=2, pp=2, microbatches=3).validate_batch(12)
    with pytest.raises(ValueError, match=r"^run.tokens_per_step: 9 sequences do not split over dp=2$"):
        ParallelConfig(dp=2).validate_batch(9, field="run.tokens_per_step")
    with pytest.raises(ValueError, match=r"^parallel.microbatches: 3 sequences per rank do not split into 2 "):
        ParallelConfig(dp=2, pp=2).validate_batch(6)


def _torch_schedule_accepts(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> bool:
    """Build the engine's torch schedule for rank 0 of the layout in a fake world (nothing runs)."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from bench.run.proxy.rank.world import join_fake_world, leave_fake_world
    from moe_engine.config import PipelineSchedule
    from moe_engine.parallel.pipeline import _SCHEDULES

    schedule_class = _SCHEDULES[PipelineSchedule(schedule)]
    stages_total = pp * virtual_stages
    join_fake_world(0, pp)
    try:
        stages = [
            PipelineStage(nn.Linear(2, 2), s, stages_total, torch.device("cpu"), group=dist.group.WORLD)
            for s in range(0, stages_total, pp)
        ]
        schedule_class(
            stages if len(stages) > 1 or schedule == "interleaved1f1b" else stages[0],
            microbatches,
            loss_fn=lambda out, target: out.sum(),
        )
        return True
    except ValueError:
        return False
    finally:
        leave_fake_world()


@pytest.mark.parametrize(
    "schedule,pp,virtual_stages",
    [
        ("gpipe", 2, 1),
        ("gpipe", 4, 1),
        ("1f1b", 2, 1),
        ("1f1b", 3, 1),
        ("1f1b", 4, 1),
        ("interleaved1f1b", 2, 1),
        ("interleaved1f1b", 2, 2),
        ("interleaved1f1b", 3, 2),
        ("interleaved1f1b", 4, 2),
        ("interleaved1f1b", 4, 3),
    ],
)
def test_validation_matches_the_torch_schedules(schedule, pp, virtual_stages):
    """For every microbatch count up to 4 * pp + 1, the config accepts exactly what torch's schedule
    constructor accepts: the smallest accepted count is the boundary, and every refusal is torch's too."""
    from moe_engine.config import PipelineSchedule
    from moe_engine.parallel.pipeline import _SCHEDULES

    assert set(_SCHEDULES) == set(PipelineSchedule), "every schedule the engine offers is checked"
    for m in range(1, 4 * pp + 2):
        config = ParallelConfig(pp=pp, schedule=schedule, virtual_stages=virtual_stages, microbatches=m)
        try:
            config.validate_executable()
            accepted = True
        except ValueError:
            accepted = False
        assert accepted == _torch_schedule_accepts(schedule, pp, virtual_stages, m), (schedule, pp, virtual_stages, m)
