"""Process groups of the rank layout on real gloo ranks."""

import pytest
import torch.distributed as dist
from distributed_harness import RankFailure, run_ranks

from moe_engine.config import ModelConfig, MoEConfig, ParallelConfig
from moe_engine.parallel.groups import build_process_groups
from moe_engine.parallel.layout import Layout


def _group_members(dp, ep, pp):
    groups = build_process_groups(Layout(ParallelConfig(dp=dp, ep=ep, pp=pp)))
    return {kind: dist.get_process_group_ranks(getattr(groups, kind)) for kind in ("dp", "ep", "edp", "pp")}


@pytest.mark.slow
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


# ---- pipeline layouts: what torch.distributed.pipelining's schedules accept ------------------


_BOUNDARY_MODEL = dict(
    vocab_size=64,
    d_model=16,
    n_layers=4,
    n_heads=2,
    n_kv_heads=2,
    seq_len=4,
    dtype="fp32",
    moe=dict(num_experts=2, top_k=1, expert_hidden=8),
)


def _step_smallest_layouts(layouts):
    """On each pipeline rank: one step of every layout, each with the fewest microbatches validation accepts."""
    import torch

    from moe_engine import build_model
    from moe_engine.parallel.pipeline import Pipeline

    model = {k: v for k, v in _BOUNDARY_MODEL.items() if k != "moe"}
    config = ModelConfig(**model, moe=MoEConfig(**_BOUNDARY_MODEL["moe"]))
    losses = []
    for kwargs in layouts:
        parallel = ParallelConfig(**kwargs)
        parallel.validate(config)
        parallel.validate_executable()
        pipeline = Pipeline(
            build_model(config, seed=0),
            parallel,
            Layout(parallel).stage_indices(dist.get_rank()),
            dist.group.WORLD,
            torch.device("cpu"),
        )
        tokens = torch.randint(0, 64, (4, 5), generator=torch.Generator().manual_seed(0))
        loss = pipeline.step(tokens[:, :-1], tokens[:, 1:])
        losses.append(None if loss is None else float(loss))
    return losses


@pytest.mark.slow
def test_the_smallest_accepted_microbatch_counts_run_on_two_ranks():
    """The boundary on real ranks: gpipe and interleaved 1F1B with one microbatch, 1F1B with pp of them."""
    smallest = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2)):
        layouts = (dict(pp=2, schedule=schedule, virtual_stages=v, microbatches=m) for m in range(1, 8))
        smallest.append(next(layout for layout in layouts if _accepts(ParallelConfig(**layout))))
    assert [layout["microbatches"] for layout in smallest] == [1, 2, 1]
    ranks = run_ranks(_step_smallest_layouts, 2, smallest, timeout=120)
    assert ranks[0] == [None, None, None]
    assert all(loss is not None and loss > 0 for loss in ranks[1])


def _accepts(config: ParallelConfig) -> bool:
    try:
        config.validate_executable()
    except ValueError:
        return False
    return True
