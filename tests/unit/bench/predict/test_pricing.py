"""Work of traced ops and their prices on a profile, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import yaml
from profiles import profile_with

from bench.predict.device import DEVICES_DIR, ProfileError, load_profile, profile_from_dict
from bench.predict.ops import TensorSpec, TracedOp, op_kind, op_work, region_op
from bench.predict.pricing import op_seconds, price_ops


def spec(*shape, dtype="torch.bfloat16"):
    return TensorSpec(tuple(shape), dtype)


def op(name, inputs, outputs, stage="forward", **kw):
    return TracedOp(name, tuple(inputs), tuple(outputs), stage, **kw)


def test_gemm_flops_and_bytes_by_hand():
    mm = op("aten.mm.default", [spec(64, 32), spec(32, 16)], [spec(64, 16)])
    assert op_work(mm).flops == 2 * 64 * 16 * 32
    assert op_work(mm).nbytes == 2 * (64 * 32 + 32 * 16 + 64 * 16)
    addmm = op("aten.addmm.default", [spec(16), spec(64, 32), spec(32, 16)], [spec(64, 16)])
    assert op_work(addmm).flops == 2 * 64 * 16 * 32
    bmm = op("aten.bmm.default", [spec(3, 8, 5), spec(3, 5, 7)], [spec(3, 8, 7)])
    assert op_work(bmm).flops == 2 * 3 * 8 * 7 * 5


def test_grouped_gemm_counts_only_rows_inside_groups():
    # Forward: x (M=100 rows, 8 of them padding) @ w (4 experts, K=32, N=48).
    fwd = op(
        "aten._grouped_mm.default",
        [spec(100, 32), spec(4, 32, 48), spec(4, dtype="torch.int32")],
        [spec(100, 48)],
        group_rows=(20, 30, 40, 2),
    )
    assert op_work(fwd).flops == 2 * 92 * 32 * 48
    assert op_work(fwd).groups == 4
    # Weight gradient: grad_y^T (N=48, M=100) @ x (M=100, K=32) -> (4, 48, 32), groups along M.
    wgrad = op(
        "aten._grouped_mm.default",
        [spec(48, 100), spec(100, 32), spec(4, dtype="torch.int32")],
        [spec(4, 48, 32)],
        group_rows=(20, 30, 40, 2),
    )
    assert op_work(wgrad).flops == 2 * 48 * 32 * 92
    # Routes unknown (learned routing): the buffer's rows.
    unknown = op(
        "aten._grouped_mm.default", [spec(100, 32), spec(4, 32, 48), spec(4, dtype="torch.int32")], [spec(100, 48)]
    )
    assert op_work(unknown).flops == 2 * 100 * 32 * 48


def test_weight_gradient_accumulated_in_its_gemm_is_the_grouped_gemm_plus_its_output_read():
    # grouped_wgrad_accumulate(a_NM, b_NK, offsets, out_EMK): out[e] += a[rows e]^T b[rows e], the
    # same product as the weight gradient above (N=100 rows, 92 in groups; M=48, K=32), into an fp32
    # out that the GEMM reads and writes (4 x 48 x 32 x 4 bytes each way).
    fused = op(
        "moe_engine.grouped_wgrad_accumulate.default",
        [spec(100, 48), spec(100, 32), spec(4, dtype="torch.int32"), spec(4, 48, 32, dtype="torch.float32")],
        [],
        group_rows=(20, 30, 40, 2),
    )
    work = op_work(fused)
    assert op_kind(fused) == "grouped_gemm"
    assert work.flops == 2 * 48 * 32 * 92
    assert work.groups == 4 and work.grouped_reduction
    assert work.shape == (4, 23, 48, 32)  # (groups, rows per group, N, K) as a profile measures them
    assert work.nbytes == 2 * 100 * 48 + 2 * 100 * 32 + 4 * 4 + 2 * (4 * 48 * 32 * 4)
    assert work.dtype == "torch.bfloat16"


def test_dense_weight_gradient_accumulated_in_its_gemm_is_the_gemm_plus_its_output_read():
    # wgrad_accumulate(a_NM, b_NK, out_MK): out += a^T b, a dense projection's weight gradient from
    # N=100 rows (M=48 outputs, K=32 inputs), into an fp32 out that cuBLAS reads and writes (48 x 32 x 4
    # bytes each way).
    fused = op(
        "moe_engine.wgrad_accumulate.default",
        [spec(100, 48), spec(100, 32), spec(48, 32, dtype="torch.float32")],
        [],
        stage="backward",
    )
    work = op_work(fused)
    assert op_kind(fused) == "gemm"
    assert work.flops == 2 * 48 * 32 * 100
    assert work.shape == (48, 32, 100)  # (M, N, K) of the product, K the reduction
    assert work.nbytes == 2 * 100 * 48 + 2 * 100 * 32 + 2 * (48 * 32 * 4)
    assert work.dtype == "torch.bfloat16"
    # The same rows as (4, 25, X) operands, a projection's (batch, sequence, features): the op's N is 4 x 25.
    batched = op(
        "moe_engine.wgrad_accumulate.default",
        [spec(4, 25, 48), spec(4, 25, 32), spec(48, 32, dtype="torch.float32")],
        [],
        stage="backward",
    )
    assert op_work(batched) == work


def test_attention_flops_causal_forward_and_backward():
    q = spec(2, 4, 128, 64)
    fwd = op(
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        [q, q, q],
        [q, spec(2, 4, 128, dtype="torch.float32")],
        arguments=(("dropout_p", 0.0), ("is_causal", True)),
    )
    assert op_kind(fwd) == "attention"
    assert op_work(fwd).flops == 4 * 2 * 4 * 128 * 128 * 64 / 2
    bwd = op(
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
        [q, q, q, q, q],
        [q, q, q],
        stage="backward",
        arguments=(("is_causal", True),),
    )
    assert op_work(bwd).flops == 2.5 * 4 * 2 * 4 * 128 * 128 * 64 / 2
    full = op(
        "aten._scaled_dot_product_flash_attention.default",
        [q, q, q],
        [q],
        arguments=(("dropout_p", 0.0), ("is_causal", False), ("return_debug_mask", False)),
    )
    assert op_work(full).flops == 4 * 2 * 4 * 128 * 128 * 64


def test_memory_and_free_ops():
    add_ = op(
        "aten.add_.Tensor",
        [spec(10, 10, dtype="torch.float32"), spec(10, 10, dtype="torch.float32")],
        [spec(10, 10, dtype="torch.float32")],
    )
    # Reads both, writes the destination: 3 tensors of 400 bytes.
    assert op_work(add_).kind == "memory" and op_work(add_).nbytes == 1200
    view = op("aten.view.default", [spec(10, 10)], [spec(100)])
    assert op_work(view).kind == "free" and op_work(view).nbytes == 0
    coll = op(
        "c10d.allreduce_.default",
        [spec(100)],
        [spec(100)],
        collective={"op": "all_reduce", "ranks": [0, 1], "nbytes": 200, "group_name": "0"},
    )
    assert op_kind(coll) == "collective"


def test_mx_region_is_one_gemm_at_the_mx_rate():
    a = spec(256, 64, dtype="torch.float32")
    b = spec(4, 64, 128, dtype="torch.float32")
    ops = [
        op(
            "aten.mul.Tensor",
            [spec(256, 64, dtype="torch.float8_e4m3fn")],
            [a],
            region="mxfp8.grouped_mm",
            region_call=1,
        ),
        op(
            "aten._grouped_mm.default",
            [a, b, spec(4, dtype="torch.int32")],
            [spec(256, 128, dtype="torch.float32")],
            region="mxfp8.grouped_mm",
            region_call=1,
            group_rows=(64, 64, 64, 64),
        ),
    ]
    work = region_op(ops, "mxfp8.grouped_mm")
    assert work.kind == "mx_gemm" and work.dtype == "mxfp8"
    assert work.flops == 2 * 256 * 64 * 128
    assert work.nbytes == pytest.approx((256 * 64 + 4 * 64 * 128) * (1 + 1 / 32) + 256 * 128 * 4)


# ---- prices -------------------------------------------------------------------------------------


def test_declared_roofline_by_hand():
    p = profile_with(
        **{
            "peak_tflops.bf16": 1000.0,
            "hbm_gbps": 2000.0,
            "efficiency.gemm": 0.5,
            "efficiency.memory": 0.8,
            "efficiency.launch_overhead_us": 5.0,
            "efficiency.attention": 0.25,
        }
    )
    big = op_work(op("aten.mm.default", [spec(4096, 4096), spec(4096, 4096)], [spec(4096, 4096)]))
    # Compute-bound: 2 * 4096^3 FLOPs at 500 TFLOP/s, plus 5 us.
    assert op_seconds(big, p) == pytest.approx(2 * 4096**3 / 500e12 + 5e-6)
    thin = op_work(op("aten.mm.default", [spec(8, 4096), spec(4096, 4096)], [spec(8, 4096)]))
    # Memory-bound: the 4096 x 4096 weight dominates the bytes, at 1600 GB/s.
    assert op_seconds(thin, p) == pytest.approx(thin.nbytes / 1600e9 + 5e-6)
    assert thin.nbytes / 1600e9 > thin.flops / 500e12
    add = op_work(op("aten.add.Tensor", [spec(1000), spec(1000)], [spec(1000)]))
    assert op_seconds(add, p) == pytest.approx(6000 / 1600e9 + 5e-6)
    q = spec(1, 8, 1024, 128)
    attn = op_work(
        op("aten._scaled_dot_product_flash_attention.default", [q, q, q], [q], arguments=(("is_causal", True),))
    )
    assert op_seconds(attn, p) == pytest.approx(4 * 8 * 1024 * 1024 * 128 / 2 / 250e12 + 5e-6)
    view = op_work(op("aten.view.default", [spec(10)], [spec(10)]))
    assert op_seconds(view, p) == 0.0


def test_curves_interpolate_in_log_log_and_extrapolate_at_the_last_throughput():
    data = yaml.safe_load((DEVICES_DIR / "h100-sxm.yaml").read_text())
    data["kind"] = "cpu"
    data["measured"] = {"date": "test"}
    data["efficiency"]["free_op_us"] = 2.0
    data["sources"]["efficiency.free_op_us"] = "test"
    data["curves"] = {
        "gemm": {"bf16": [{"work": 1e6, "seconds": 1e-5}, {"work": 1e8, "seconds": 1e-4}]},
        "grouped_gemm": {"bf16": [{"work": 1e6, "seconds": 2e-5}]},
        "memory": {"any": [{"work": 1e3, "seconds": 3e-6}, {"work": 1e9, "seconds": 1e-1}]},
    }
    p = profile_from_dict(data, "cpu.yaml")
    curve = p.curve("gemm", "bf16")
    assert curve.seconds(1e7) == pytest.approx(math.sqrt(1e-5 * 1e-4))  # the log-log midpoint
    assert curve.seconds(1e3) == pytest.approx(1e-5)  # overhead-bound below the first point
    assert curve.seconds(1e9) == pytest.approx(1e-4 * 10)  # the last point's throughput
    g = op_work(
        op(
            "aten._grouped_mm.default",
            [spec(400, 50), spec(4, 50, 100), spec(4, dtype="torch.int32")],
            [spec(400, 100)],
            group_rows=(100, 100, 100, 100),
        )
    )
    # Per group: 1e6 FLOPs -> 2e-5 s; four groups.
    assert op_seconds(g, p) == pytest.approx(4 * 2e-5)
    view = op_work(op("aten.view.default", [spec(10)], [spec(10)]))
    assert op_seconds(view, p) == pytest.approx(2e-6)  # a CPU's host pays for every op


def test_regions_priced_as_one_kernel_on_a_gpu_and_op_by_op_on_a_cpu():
    a = spec(256, 64, dtype="torch.float32")
    region = [
        op("aten.mul.Tensor", [a, a], [a], region="mxfp8.grouped_mm", region_call=7),
        op(
            "aten._grouped_mm.default",
            [a, spec(4, 64, 128, dtype="torch.float32"), spec(4, dtype="torch.int32")],
            [spec(256, 128, dtype="torch.float32")],
            region="mxfp8.grouped_mm",
            region_call=7,
            group_rows=(64,) * 4,
        ),
    ]
    after = op("aten.add.Tensor", [a, a], [a])
    gpu = profile_with()
    priced = price_ops([*region, after], gpu)
    assert [p.work.kind for p in priced] == ["mx_gemm", "free", "memory"]
    assert priced[1].seconds == 0.0
    mx = priced[0].work
    assert priced[0].seconds == pytest.approx(
        max(
            mx.flops / (gpu.peak_tflops["mxfp8"] * 1e12 * gpu.efficiency["grouped_gemm"]),
            mx.nbytes / (gpu.hbm_gbps * 1e9 * gpu.efficiency["memory"]),
        )
        + gpu.efficiency["launch_overhead_us"] * 1e-6
    )
    cpu = profile_with(kind="cpu")
    assert [p.work.kind for p in price_ops([*region, after], cpu)] == ["memory", "grouped_gemm", "memory"]


# ---- profiles -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.stem for p in DEVICES_DIR.glob("*.yaml")))
def test_shipped_profiles_load_with_a_source_for_every_number(name):
    profile = load_profile(name)
    assert profile.name == name
    for key in ("memory_gb", "hbm_gbps", "peak_tflops.bf16", "network.inter_node_gbps", "efficiency.gemm"):
        assert profile.sources[key].strip()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hbm_gbps", None, "hbm_gbps: missing"),
        ("peak_tflops.bf16", 0, "peak_tflops.bf16: must be a number > 0"),
        ("peak_tflops.fp8", -5, "peak_tflops.fp8: must be a number > 0"),
        ("network.inter_node_gbps", "fast", "network.inter_node_gbps: must be a number > 0"),
        ("efficiency.gemm", 1.5, "efficiency.gemm: is a fraction of peak"),
        ("sources.hbm_gbps", None, "sources.hbm_gbps: missing"),
    ],
)
def test_bad_profiles_name_the_file_and_the_field(field, value, message):
    data = yaml.safe_load((DEVICES_DIR / "h100-sxm.yaml").read_text())
    target = data
    *path, last = field.split(".")
    for key in path:
        target = target[key]
    if value is None:
        del target[last]
    else:
        target[last] = value
    with pytest.raises(ProfileError, match=f"^bad.yaml: {message}"):
        profile_from_dict(data, "bad.yaml")


def test_unknown_device_names_the_known_ones():
    with pytest.raises(ProfileError, match=r"unknown device 'h900'.*b300"):
        load_profile("h900")
