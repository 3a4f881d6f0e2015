"""Checkpoint resume on gloo ranks: bit-identical on one layout, resharded on another."""

from __future__ import annotations

import pytest
import torch
from checkpoint_cases import LAYOUTS, N, train_steps
from distributed_harness import run_ranks


def _run(layout: str, steps: range, save_to: str | None = None, load_from: str | None = None) -> list[dict]:
    parallel = LAYOUTS[layout]
    if parallel.world_size == 1:
        return [train_steps(parallel, steps, save_to, load_from)]
    return run_ranks(train_steps, parallel.world_size, parallel, steps, save_to, load_from, timeout=180)


def _assemble(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Whole-model parameters from every rank's boxes."""
    boxes: dict[str, list[tuple[torch.Size, torch.Tensor]]] = {}
    for rank in ranks:
        for name, box in rank["params"].items():
            boxes.setdefault(name, []).append(box)
    full = {}
    for name, parts in boxes.items():
        rows = max(o[0] + t.shape[0] for o, t in parts) if parts[0][1].ndim else None
        out = parts[0][1].new_zeros((rows, *parts[0][1].shape[1:])) if rows is not None else parts[0][1].clone()
        for offsets, tensor in parts:
            if tensor.ndim:
                out[offsets[0] : offsets[0] + tensor.shape[0]] = tensor
        full[name] = out
    return full


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """2N steps on each layout without a stop (computed once per layout)."""
    cache: dict[str, dict] = {}

    def get(layout: str) -> dict:
        if layout not in cache:
            ranks = _run(layout, range(2 * N))
            cache[layout] = {"losses": ranks[0]["losses"], "params": _assemble(ranks)}
        return cache[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "dp2-zero1", "ep2-no-sync", "pp2-1f1b", "fsdp-dp2"])
def test_resume_on_the_same_layout_is_bit_identical(layout, uninterrupted, tmp_path):
    path = str(tmp_path / "step-3")
    first = _run(layout, range(N), save_to=path)
    second = _run(layout, range(N, 2 * N), load_from=path)
    reference = uninterrupted(layout)
    assert first[0]["losses"] + second[0]["losses"] == reference["losses"]
    resumed = _assemble(second)
    assert resumed.keys() == reference["params"].keys()
    for name, tensor in reference["params"].items():
        assert torch.equal(resumed[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "saved, loaded", [("ep2-no-sync", "dp2"), ("pp2-1f1b", "pp1-microbatches2"), ("dp2-zero1", "dp2")]
)
def test_resume_on_another_layout_reshards(saved, loaded, uninterrupted, tmp_path):
    path = str(tmp_path / "step-3")
    _run(saved, range(N), save_to=path)
    second = _run(loaded, range(N, 2 * N), load_from=path)
    reference = uninterrupted(saved)
    torch.testing.assert_close(second[0]["losses"], reference["losses"][N:], rtol=1e-5, atol=1e-5)
    resumed = _assemble(second)
    for name, tensor in reference["params"].items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
