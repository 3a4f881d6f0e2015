"""The MoE layer's forward and backward never synchronise with the host, where that holds.

The guarantee, exactly: the engine's own code (routing, permutation, dispatch, combine, losses) issues
no host sync on any device, for every routing mode and dtype. The grouped GEMM inside the experts is
sync-free only on its CUTLASS path (bf16 on sm9x/sm10x); on every other device and dtype torch's
kernel reads the offsets on the host, once per expert and GEMM (``moe_engine.moe.grouped_gemm``).

Two checks: ``forbid_host_sync`` (raises where a sync is issued from Python or autograd; on CUDA also
the CUDA sync debug mode) and ``profile_host_syncs`` (every sync at any depth, which also sees the
ones inside ATen kernels that the first is blind to).
"""

import pytest
import torch

from moe_engine import ModelConfig, build_model
from moe_engine.config import ExpertBackendKind, MoEConfig, RoutingMode
from moe_engine.host_sync import HostSyncError, forbid_host_sync, profile_host_syncs
from moe_engine.moe.grouped_gemm import GroupedMMPath, grouped_mm_path
from moe_engine.moe.layer import MoELayer

GROUPED_MM_CALLS_PER_STEP = 6
"""Grouped GEMMs of one expert forward + backward: 2 fprop, 2 dgrad, 2 wgrad."""


def _assert_syncs_only_in_the_grouped_gemm(step, device, dtype, experts: int, moe_layers: int) -> None:
    """Run ``step`` under both checks and require exactly the grouped GEMM's own syncs, no others."""
    fast = grouped_mm_path(device, dtype) is GroupedMMPath.CUTLASS
    if fast or device.type == "cpu":  # on CUDA the fallback's syncs would trip the CUDA sync debug mode
        with forbid_host_sync():
            syncs = profile_host_syncs(step)
    else:
        syncs = profile_host_syncs(step)
    outside = [s for s in syncs if not s.inside("aten::_grouped_mm")]
    assert outside == [], f"host syncs outside the grouped GEMM: {outside[:3]}"
    if fast:
        assert syncs == []
    elif device.type == "cpu":  # the CPU kernel reads each group's offset once per GEMM
        assert len([s for s in syncs if s.name == "aten::_local_scalar_dense"]) == (
            GROUPED_MM_CALLS_PER_STEP * experts * moe_layers
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", list(RoutingMode))
def test_moe_layer_has_no_host_sync(routing, dtype, device):
    torch.manual_seed(0)
    layer = MoELayer(32, MoEConfig(num_experts=8, top_k=2, expert_hidden=32, routing=routing, shared_expert_hidden=16))
    layer = layer.to(device=device, dtype=dtype)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(64, 32, device=device, dtype=dtype, requires_grad=True)

    def step():
        y = layer(x)
        y.backward(torch.randn_like(y))

    _assert_syncs_only_in_the_grouped_gemm(step, device, dtype, experts=8, moe_layers=1)
    assert x.grad is not None and layer.experts.gate_up.grad is not None


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_training_step_has_no_host_sync(dtype, device):
    config = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        seq_len=16,
        n_dense_layers=1,
        dense_hidden=48,
        qk_norm=True,
        dtype=dtype,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, routing="random", expert_bias_rate=0.01),
    )
    torch.manual_seed(0)
    model = build_model(config, device=device)
    tokens = torch.randint(0, 64, (2, 16), device=device)

    def step():
        model.loss(tokens, tokens).backward()
        for layer in model.moe_layers():
            layer.update_expert_bias()

    _assert_syncs_only_in_the_grouped_gemm(step, device, config.dtype.torch_dtype, experts=4, moe_layers=1)


def test_the_profiler_sees_syncs_inside_aten_kernels_that_the_guard_cannot(device):
    """``_grouped_mm``'s CPU kernel reads its offsets on the host: the guard lets it pass (it sees
    only the op it is handed), the profiler counts one sync per group."""
    if grouped_mm_path(device, torch.float32) is GroupedMMPath.CUTLASS or device.type != "cpu":
        pytest.skip("the CPU kernel's host loop is what this shows")
    a, b = torch.randn(12, 16, device=device), torch.randn(3, 16, 8, device=device)
    offsets = torch.tensor([4, 8, 12], dtype=torch.int32, device=device)
    with forbid_host_sync():
        syncs = profile_host_syncs(lambda: torch._grouped_mm(a, b, offs=offsets))
    assert [s.name for s in syncs] == ["aten::_local_scalar_dense"] * 3
    assert all(s.inside("aten::_grouped_mm") for s in syncs)


def test_the_profiler_sees_an_engine_sync_outside_the_grouped_gemm(device, monkeypatch):
    """A sync planted in the engine's own code is reported outside the grouped GEMM."""
    import moe_engine.moe.permute as permute

    real = permute.ExpertGroups.from_counts

    def from_counts_with_a_sync(counts_E):
        counts_E.sum().item()
        return real(counts_E)

    monkeypatch.setattr(permute.ExpertGroups, "from_counts", staticmethod(from_counts_with_a_sync))
    layer = MoELayer(32, MoEConfig(num_experts=4, top_k=2, expert_hidden=32)).to(device)
    x = torch.randn(16, 32, device=device)
    syncs = profile_host_syncs(lambda: layer(x))
    assert any(not s.inside("aten::_grouped_mm") for s in syncs)


def test_reference_backend_is_caught(device):
    """The guard is not blind: the loop reference reads counts on the host and must be caught."""
    layer = MoELayer(16, MoEConfig(num_experts=4, top_k=1, expert_hidden=16, backend=ExpertBackendKind.LOOP))
    layer = layer.to(device)
    with pytest.raises(HostSyncError, match="tolist"):
        with forbid_host_sync():
            layer(torch.randn(8, 16, device=device))


@pytest.mark.parametrize(
    "offence, message",
    [
        (lambda t: t.sum().item(), "item"),
        (lambda t: t.tolist(), "tolist"),
        (lambda t: t.cpu(), "cpu"),
        (lambda t: torch.nonzero(t), "nonzero"),
        (lambda t: t.nonzero(), "nonzero"),
        (lambda t: t[t > 0], "boolean-mask"),
        (lambda t: torch.where(t > 0), "where"),
        (lambda t: bool(t.sum() > 0), "__bool__"),
        (lambda t: t.masked_select(t > 0), "masked_select"),
        (lambda t: torch.unique(t), "unique"),
        (lambda t: torch.bincount((t > 0).long()), "bincount"),
        (lambda t: torch.repeat_interleave((t > 0).long()), "repeat_interleave"),
        (lambda t: t.index_put_((t > 0,), t.new_zeros(())), "index_put"),
        (lambda t: t + torch.tensor(1.0, device=t.device), "host-to-device copy: aten::lift_fresh"),
        (lambda t: t + torch.as_tensor([1.0], device=t.device), "host-to-device copy: aten::lift_fresh"),
    ],
)
def test_each_syncing_call_is_caught(offence, message, device):
    t = torch.randn(8, device=device)
    expected: type[RuntimeError] = HostSyncError
    if device.type == "cuda" and "lift_fresh" in message:
        # torch.tensor / torch.as_tensor copy to the device inside their constructor, below the
        # dispatcher, where CUDA's sync debug mode raises its plain RuntimeError before the guard
        # sees aten::lift_fresh: on a GPU either error names the same offence.
        expected, message = RuntimeError, f"{message}|called a synchronizing CUDA operation"
    with pytest.raises(expected, match=message):
        with forbid_host_sync():
            offence(t)


@pytest.mark.parametrize(
    "op, args, kwargs, copies",
    [
        (torch.ops.aten._to_copy.default, ("cpu",), {"device": "cuda"}, True),
        (torch.ops.aten._to_copy.default, ("cpu",), {"device": "cuda", "non_blocking": True}, False),
        (torch.ops.aten._to_copy.default, ("cpu",), {"device": "cpu"}, False),
        (torch.ops.aten._to_copy.default, ("cpu",), {"dtype": torch.bfloat16}, False),
        (torch.ops.aten._to_copy.default, ("cpu",), {"device": "meta"}, False),
        (torch.ops.aten._to_copy.default, ("cuda",), {"device": "cpu"}, False),
        (torch.ops.aten.copy_.default, ("cuda", "cpu"), {}, True),
        (torch.ops.aten.copy_.default, ("cuda", "cpu", True), {}, False),
        (torch.ops.aten.copy_.default, ("cpu", "cpu"), {}, False),
        (torch.ops.aten.copy_.default, ("cuda", "cuda"), {}, False),
    ],
)
def test_host_to_device_copies_are_recognised_without_a_gpu(op, args, kwargs, copies):
    """What a blocking host-to-device copy looks like at the dispatcher, shown with fake CUDA tensors:
    on a GPU, CUDA's sync debug mode raises a plain RuntimeError for it, so the guard names it first."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from moe_engine.host_sync import _copies_from_host

    with FakeTensorMode():
        cuda = torch.empty(4, device="cuda")
    tensors = {"cpu": torch.ones(4), "cuda": cuda}
    args = tuple(tensors.get(a, a) if isinstance(a, str) else a for a in args)
    kwargs = {k: torch.device(v) if k == "device" else v for k, v in kwargs.items()}
    assert _copies_from_host(op, args, kwargs) is copies


def test_tensors_made_before_the_guarded_block_are_allowed(device):
    bias = torch.tensor([0.5, -0.5], device=device)
    with forbid_host_sync():
        y = torch.ones(2, device=device) + bias
    assert y.tolist() == [1.5, 0.5]


def test_the_profiler_does_not_count_syncs_around_the_measured_function(device, monkeypatch):
    """On CUDA the profiler synchronises the device on exit, while it still records: that sync is the
    profiler's, not the measured function's. Planted here as a host read in the profiler's stop."""
    from torch.profiler import profile

    real_stop = profile.stop

    def stop_with_a_sync(self):
        torch.ones(1, device=device).sum().item()
        real_stop(self)

    monkeypatch.setattr(profile, "stop", stop_with_a_sync)
    x = torch.randn(4, device=device)
    assert profile_host_syncs(lambda: x * 2) == []
    assert [s.name for s in profile_host_syncs(lambda: (x * 2).sum().item())] == ["aten::_local_scalar_dense"]


def test_a_function_without_work_has_no_profiled_sync(device):
    """The smallest check of the profiler's own sync on a GPU: nothing measured, nothing counted."""
    torch.ones(1, device=device)  # the CUDA context exists, so the profiler records CUDA activity
    assert profile_host_syncs(lambda: None) == []


def test_shapes_known_on_the_host_are_allowed(device):
    t = torch.tensor([1, 0, 2], device=device)
    with forbid_host_sync():
        torch.arange(3, device=device).repeat_interleave(t, output_size=3)
        torch.zeros(3, device=device).index_put_((t,), torch.ones(3, device=device))


def test_syncs_inside_autograd_backward_are_caught(device):
    class SyncsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad.max().item()
            return grad

    x = torch.randn(4, device=device, requires_grad=True)
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            SyncsInBackward.apply(x).sum().backward()


def test_guard_restores_normal_operation(device):
    with forbid_host_sync():
        pass
    assert torch.ones(2, device=device).sum().item() == 2.0
