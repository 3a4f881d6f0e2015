"""bench.run.work: the exact work counters of one step, in every execute result, and the gate on them.

The counters are checked against hand-computed values; the planted changes (an extra copy, an extra
host sync) are planted here, by monkeypatching the engine for one run. The extra all-reduce of two
ranks is tests/integration/workers/test_work_runs.py's.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from result_docs import make_doc
from tiny_models import tiny_bf16_trainer
from torch.utils.flop_counter import FlopCounterMode
from work_runs import TINY_UNFUSED, execute_once, run_gate, work_census, write_side, write_sides

from bench.cli import main
from bench.gate.work import work_verdicts
from bench.metrics import WORK_METRIC_NAMES, spec_of
from bench.results import write_result
from bench.run.memory import TensorMemoryTracker
from bench.run.work import WORK_METRICS as WRITTEN
from bench.run.work import count_step_work
from bench.scenario import scenario_from_dict
from moe_engine.flops import training_flops_per_token
from moe_engine.model import Block, Transformer

CPU = torch.device("cpu")


def _contiguous_square_sum(y: torch.Tensor) -> torch.Tensor:
    # The grouped GEMM's backward refuses the zero-stride gradient of a plain .sum().
    return (y * y).sum()


# ---- the counters, by hand ---------------------------------------------------------------------


def test_torch_counts_no_grouped_gemm_flops_by_itself():
    # Why bench.run.work registers a formula: FlopCounterMode of torch 2.13 counts 0 for it.
    x, w = torch.randn(8, 4), torch.randn(2, 4, 8)
    with FlopCounterMode(display=False) as counter:
        torch._grouped_mm(x, w, offs=torch.tensor([4, 8], dtype=torch.int32))
    assert counter.get_total_flops() == 0


def test_grouped_gemm_flops_cover_only_the_rows_the_offsets_cover():
    torch.manual_seed(0)
    x_MK = torch.randn(12, 16, requires_grad=True)  # 12 rows, only 10 covered: 2 padding rows
    w_GNK = torch.randn(3, 24, 16, requires_grad=True)
    offsets = torch.tensor([4, 8, 10], dtype=torch.int32)
    a_GMK, b_GKN = torch.randn(3, 5, 16), torch.randn(3, 16, 8)

    def step():
        y_MN = torch._grouped_mm(x_MK, w_GNK.transpose(1, 2), offs=offsets)
        _contiguous_square_sum(y_MN).backward()
        torch._grouped_mm(a_GMK, b_GKN)  # 3-D x 3-D: no offsets

    work = count_step_work(step, CPU)
    rows, k, n = 10, 16, 24
    forward = 2 * rows * k * n
    # backward: the input gradient (2-D x 3-D over the covered rows) and the weight gradient
    # (2-D x 2-D over the covered reduction length), each as much as the forward.
    batched = 2 * 3 * 5 * 16 * 8
    assert work.flops_by_op == {"aten._grouped_mm": 3 * forward + batched}
    # the elementwise square and sum are no matmul: nothing else is counted
    assert work.matmul_flops == 3 * forward + batched


def test_matmul_and_cpu_attention_flops_by_hand():
    torch.manual_seed(0)
    x, w = torch.randn(12, 16, requires_grad=True), torch.randn(16, 5, requires_grad=True)
    q = torch.randn(2, 4, 8, 16, requires_grad=True)  # B, H, S, d
    kv = [torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(2)]  # grouped-query: 2 kv heads

    def step():
        out = F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True)
        ((x @ w).sum() + out.sum()).backward()

    work = count_step_work(step, CPU)
    # x @ w forward, and both gradients of the same size
    assert work.flops_by_op["aten.mm"] == 3 * 2 * 12 * 16 * 5
    # QK^T and AV over the full 8 x 8 score matrix (torch's convention: the causal mask not halved)
    forward = 2 * (2 * 2 * 4 * 8 * 8 * 16)
    assert work.flops_by_op["aten._scaled_dot_product_flash_attention_for_cpu"] == forward
    # backward recomputes the scores: 5 GEMMs of the forward's 2
    assert work.flops_by_op["aten._scaled_dot_product_flash_attention_for_cpu_backward"] == forward * 5 // 2
    assert work.matmul_flops == sum(work.flops_by_op.values())


def test_dense_weight_gradient_added_in_its_gemm_is_counted_once():
    from moe_engine import kernels

    a_NM, b_NK = torch.randn(12, 6).bfloat16(), torch.randn(12, 10).bfloat16()
    out_MK = torch.zeros(6, 10)
    work = count_step_work(lambda: kernels.wgrad_accumulate(a_NM, b_NK, out_MK), CPU)
    # out (6 x 10) += a^T b over 12 rows; the product and the add inside the op are not counted again.
    assert work.flops_by_op == {"moe_engine.wgrad_accumulate": 2 * 6 * 10 * 12}
    # The rows as (3, 4) leading dims count the same.
    work = count_step_work(lambda: kernels.wgrad_accumulate(a_NM.view(3, 4, 6), b_NK.view(3, 4, 10), out_MK), CPU)
    assert work.flops_by_op == {"moe_engine.wgrad_accumulate": 2 * 6 * 10 * 12}


def test_op_count_of_a_known_function_includes_autograds_backward():
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)

    work = count_step_work(lambda: (a * b).sum().backward(), CPU)
    # forward: mul, sum; backward (run by the C++ autograd engine): the seed gradient (ones_like),
    # SumBackward's expand, MulBackward's two muls, and AccumulateGrad's detach of each new .grad
    assert work.ops_by_name == {
        "aten.mul.Tensor": 3,
        "aten.sum.default": 1,
        "aten.ones_like.default": 1,
        "aten.expand.default": 1,
        "aten.detach.default": 2,
    }
    assert work.aten_ops == 8


def test_allocated_bytes_count_every_allocation_not_the_peak():
    x = torch.zeros(1000)  # before the block: never counted

    def step():
        y = x + 1  # 4000 bytes
        y.add_(1)  # in place: nothing new
        z = y * 2  # 4000
        del y
        w = z.clone()  # 4000, after y was freed: the peak stays lower than the total
        w.resize_(2000)  # grows by 4000
        torch.empty(0)  # 0 bytes

    tracker_peak = TensorMemoryTracker()
    with tracker_peak:
        step()
    work = count_step_work(step, CPU)
    assert work.allocator == "tensor-tracker"
    assert work.allocated_bytes == 16000
    assert work.allocated_by_op == {
        "aten.add.Tensor": 4000,
        "aten.mul.Tensor": 4000,
        "aten.clone.default": 4000,
        "aten.resize_.default": 4000,
    }
    assert tracker_peak.allocated == 16000 and tracker_peak.peak == 12000


def test_on_cuda_allocations_come_from_the_allocators_counters(monkeypatch):
    # The wiring only (this machine may have no GPU): the step's requests are the count, the blocks kept.
    stats = iter(
        [
            {"requested_bytes.all.allocated": 100, "allocated_bytes.all.allocated": 512},
            {"requested_bytes.all.allocated": 1100, "allocated_bytes.all.allocated": 2048},
        ]
    )
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: next(stats))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    work = count_step_work(lambda: torch.ones(8) * 2, torch.device("cuda"))
    assert (work.allocator, work.allocated_bytes, work.cuda_block_bytes) == ("cuda-allocator", 1000, 1536)
    assert work.allocated_by_op == {} and work.ops_by_name == {"aten.ones.default": 1, "aten.mul.Tensor": 1}


def test_host_syncs_by_site():
    x, w = torch.randn(6, 4), torch.randn(3, 4, 4)
    offsets = torch.tensor([2, 4, 6], dtype=torch.int32)

    def step():
        torch._grouped_mm(x, w, offs=offsets)  # the CPU kernel reads each group's offset on the host
        x.sum().item()
        x.max().item()

    work = count_step_work(step, CPU)
    assert work.syncs_by_site == {"aten::_grouped_mm": 3, "aten::item": 2}
    assert work.host_syncs == 5


def test_the_gate_knows_every_counter_the_run_writes():
    gated = {name for name in WRITTEN if spec_of(name).gated}
    assert gated == set(WORK_METRIC_NAMES)
    assert set(WRITTEN) - gated == {"work_flops_ratio"}


# ---- an execute run --------------------------------------------------------------------------------

# TINY_UNFUSED: fp32, 2 layers, 8 experts top-2, random routing, 128 tokens a step, the reference step.


def test_execute_counts_the_flops_the_model_runs_and_repeats_them_exactly():
    first, second = execute_once(), execute_once()
    metrics, details = first
    work = {name: entry for name, entry in metrics.items() if name.startswith("work_")}
    assert set(work) == set(WRITTEN)
    for name, entry in work.items():
        assert entry["spread"] is None and len(entry["samples"]) == 1, name
        assert (entry["unit"], entry["better"]) == (spec_of(name).unit, spec_of(name).better)
        assert entry == second[0][name], f"{name} differs between two runs"
    assert work_census(details) == work_census(second[1])

    # The executed FLOPs, by hand, from the formula (moe_engine.flops, Megatron's convention) and
    # what it leaves out or counts otherwise:
    model = scenario_from_dict(TINY_UNFUSED).model
    tokens, layers, d, s = 128, model.n_layers, model.d_model, model.seq_len
    q_dim, experts, top_k = model.n_heads * model.head_dim, model.moe.num_experts, model.moe.top_k
    formula = training_flops_per_token(model, s) * tokens
    formula_attention = layers * 6 * 2 * s * q_dim * 0.5 * tokens
    torch_attention = layers * (4 * s * q_dim) * 3.5 * tokens  # full scores, backward 2.5x forward
    router = layers * 6 * d * experts * tokens  # scores, their input and weight gradients
    combine = layers * 6 * top_k * d * tokens  # the weighted sum of the k expert outputs (a bmm)
    executed = formula - formula_attention + torch_attention + router + combine
    assert metrics["work_matmul_flops"]["median"] == executed
    assert metrics["work_flops_ratio"]["median"] == pytest.approx(executed / formula)
    (rank,) = details["work"]["ranks"]
    assert rank["formula_flops"] == formula and rank["flops_ratio"] == pytest.approx(executed / formula)
    assert rank["collectives"] == [] and metrics["work_collective_calls"]["median"] == 0
    assert rank["allocator"] == "tensor-tracker" and rank["allocated_bytes"] > 0
    # CPU grouped GEMMs read every expert's offset on the host: 8 experts x 6 GEMMs x 2 layers
    assert rank["syncs_by_site"]["aten::_grouped_mm"] == 8 * 6 * 2


# ---- planted changes and the gate --------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    """The tiny scenario as it is, with an extra copy in every block, and with an extra host sync."""
    base = execute_once()
    original_block, original_model = Block.forward, Transformer.forward
    try:
        Block.forward = lambda self, x, rope: original_block(self, x, rope).clone()
        copied = execute_once()
        Block.forward = original_block

        def syncing(self, tokens):
            logits = original_model(self, tokens)
            logits.detach()[0, 0, 0].item()
            return logits

        Transformer.forward = syncing
        synced = execute_once()
    finally:
        Block.forward, Transformer.forward = original_block, original_model
    return {"base": base, "copy": copied, "sync": synced}


def test_an_extra_copy_is_more_work_and_fails_the_gate_until_accepted(tmp_path, runs):
    base, cand = write_sides(tmp_path, runs["base"], runs["copy"])
    (before,), (after,) = runs["base"][1]["work"]["ranks"], runs["copy"][1]["work"]["ranks"]
    # one clone of the (4, 32, 64) fp32 block output in each of the 2 blocks
    clones = after["ops_by_name"]["aten.clone.default"] - before["ops_by_name"].get("aten.clone.default", 0)
    assert clones == 2
    assert after["aten_ops"] - before["aten_ops"] == 2
    assert after["allocated_bytes"] - before["allocated_bytes"] == 2 * 4 * 32 * 64 * 4
    assert after["matmul_flops"] == before["matmul_flops"] and after["host_syncs"] == before["host_syncs"]

    code, report = run_gate("--baseline", str(base), "--candidate", str(cand), "--tolerance", "50%")
    assert code == 1, report
    assert "REGRESSION tiny work_aten_ops: work increased: +2 ops per step" in report
    assert "aten.clone.default +2" in report
    assert "REGRESSION tiny work_allocated_bytes: work increased: +64 KiB allocated per step" in report
    assert "aten.clone.default +64 KiB" in report
    assert "work_matmul_flops" not in report and "work_host_syncs" not in report

    code, report = run_gate("--baseline", str(base), "--candidate", str(cand), "--accept-work")
    assert code == 0, report
    assert "NOTE tiny work_aten_ops: work increased (accepted): +2 ops per step" in report
    assert "REGRESSION" not in report and "(2 accepted work increases)" in report

    # Accepting one counter leaves the other failing.
    code, report = run_gate("--baseline", str(base), "--candidate", str(cand), "--accept-work", "work_aten_ops")
    assert code == 1 and "REGRESSION tiny work_allocated_bytes" in report
    assert "work_aten_ops: work increased (accepted)" in report

    # The other way round, less work: reported, never failed.
    code, report = run_gate("--baseline", str(cand), "--candidate", str(base))
    assert code == 0 and "NOTE tiny work_aten_ops: work decreased: -2 ops per step" in report


def test_an_extra_host_sync_is_more_work(tmp_path, runs):
    (before,), (after,) = runs["base"][1]["work"]["ranks"], runs["sync"][1]["work"]["ranks"]
    assert after["host_syncs"] - before["host_syncs"] == 1
    assert after["syncs_by_site"]["aten::item"] - before["syncs_by_site"].get("aten::item", 0) == 1
    base, cand = write_sides(tmp_path, runs["base"], runs["sync"])
    code, report = run_gate("--baseline", str(base), "--candidate", str(cand))
    assert code == 1
    assert "REGRESSION tiny work_host_syncs: work increased: +1 host sync per step" in report
    assert "aten::item +1" in report


def test_compare_prints_the_work_verdicts(tmp_path, runs, capsys):
    base, cand = write_sides(tmp_path, runs["base"], runs["sync"])
    assert main(["compare", str(base), str(cand), "--accept-work"]) == 0
    out = capsys.readouterr().out
    assert "NOTE tiny work_host_syncs: work increased (accepted): +1 host sync per step" in out
    assert main(["compare", str(base), str(cand), "--accept-work=work_nonsense"]) == 2


def test_documents_without_work_counters_get_no_work_verdict(tmp_path, runs):
    old = make_doc(
        "tiny",
        {"peak_tensor_bytes": {"unit": "bytes", "better": "lower", "samples": [1.0], "median": 1.0, "spread": None}},
        spec=TINY_UNFUSED,
    )
    assert work_verdicts("tiny", old, runs["copy"]) == [
        "NOTE tiny: no work counters on one side (the baseline); work not compared"
    ]
    assert work_verdicts("tiny", old, old) == []
    folder = tmp_path / "old"
    write_result(old, folder / "v" / "m")
    cand = write_side(tmp_path, "cand", "tiny", runs["copy"])
    code, report = run_gate("--baseline", str(folder), "--candidate", str(cand))
    assert code == 0, report
    assert "no work counters on one side (the baseline)" in report
    assert "work_aten_ops: metric missing" not in report


# ---- a bf16 step with its GEMMs in fp32 ---------------------------------------------------------------


def test_the_counts_of_a_bf16_step_are_the_same_with_its_gemms_in_fp32():
    """``moe-bench run`` counts a bf16 step with ``BF16GemmsInFp32`` below the counters (entered first):
    every count, and the memory tracker's peak, equal those of the native bf16 step, so the work
    metrics of a CPU without bf16 arithmetic compare exactly with any other's."""
    from moe_engine.precision.cpu_bf16 import BF16GemmsInFp32

    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(7))
    counts, peaks = [], []
    for mode in (None, BF16GemmsInFp32()):
        _, trainer = tiny_bf16_trainer()
        with mode or contextlib.nullcontext():
            work = count_step_work(functools.partial(trainer.step, tokens[:, :-1], tokens[:, 1:]), torch.device("cpu"))
            with TensorMemoryTracker(trainer.resident_tensors()) as tracker:
                trainer.step(tokens[:, :-1], tokens[:, 1:])
        counts.append({k: v for k, v in work.to_dict().items() if k != "seconds"})
        peaks.append(tracker.peak)
    assert counts[0]["matmul_flops"] > 0 and counts[0]["ops_by_name"]["aten._grouped_mm.default"] > 0
    assert counts[1] == counts[0]
    assert peaks[1] == peaks[0]
