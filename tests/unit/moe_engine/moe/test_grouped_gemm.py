"""The checked grouped GEMM: the CUDA kernel's preconditions refused on every device, ragged and
empty groups, and exactly-zero weight gradients for experts without tokens."""

from __future__ import annotations

import pytest
import torch
from tolerances import tolerance

from moe_engine import ModelConfig, build_model
from moe_engine.config import ExpertBackendKind, MoEConfig
from moe_engine.moe.experts import GroupedExperts
from moe_engine.moe.grouped_gemm import GroupedMMError, GroupedMMPath, grouped_mm, grouped_mm_path
from moe_engine.moe.permute import ExpertGroups
from moe_engine.parallel.data_parallel import DataParallelOptimizer
from moe_engine.train import OptimizerConfig

SEED = 20261201


def _per_group_reference(a_MK, b_EKN, counts):
    """Plain matmuls, group by group: the reference the grouped GEMM must equal."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(a_MK[start : start + n].double() @ b_EKN[e].double())
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_and_empty_groups_equal_per_group_matmuls(dtype, device):
    torch.manual_seed(SEED)
    counts = [5, 0, 11, 1, 0, 7]
    a_MK = torch.randn(sum(counts), 16, device=device).to(dtype)
    b_EKN = torch.randn(len(counts), 16, 8, device=device).to(dtype)
    offsets = torch.cumsum(torch.tensor(counts, device=device), 0).to(torch.int32)
    got = grouped_mm(a_MK, b_EKN, offsets)
    want = _per_group_reference(a_MK, b_EKN, counts)
    # fp32: a sum of 16 products against its exact value; bf16: that sum rounded once to bf16.
    tol = tolerance(torch.float32, 16) if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), want.to(got.device), rtol=tol, atol=tol * want.abs().max().item())


def _offsets(device, counts=(4, 4)):
    return torch.cumsum(torch.tensor(counts, device=device), 0).to(torch.int32)


@pytest.mark.parametrize(
    "make, message",
    [
        # A view that starts one element into a flat buffer: what a parameter re-homed into a
        # gradient bucket at an unaligned offset looks like.
        (
            lambda d: (torch.zeros(8 * 16 + 1, device=d)[1:].view(8, 16), torch.zeros(2, 16, 8, device=d)),
            "a: data pointer is not 16-byte aligned",
        ),
        # fp32 rows of 6 elements: a 24-byte leading stride.
        (lambda d: (torch.zeros(8, 6, device=d), torch.zeros(2, 6, 8, device=d)), "a: leading stride 6 x 4 bytes"),
        (lambda d: (torch.zeros(8, 32, device=d)[:, ::2], torch.zeros(2, 16, 8, device=d)), "a: needs unit stride"),
        (lambda d: (torch.zeros(8, 16, device=d), torch.zeros(2, 16, 6, device=d)), "b: leading stride 6 x 4 bytes"),
        (
            lambda d: (torch.zeros(8, 16, device=d, dtype=torch.bfloat16), torch.zeros(2, 16, 8, device=d)),
            "one dtype expected",
        ),
    ],
)
def test_operands_the_cuda_kernel_refuses_are_refused_here(make, message, device):
    a, b = make(device)
    with pytest.raises(GroupedMMError, match=message):
        grouped_mm(a, b, _offsets(device))


def test_int64_offsets_are_refused(device):
    offsets = torch.tensor([4, 8], device=device)
    with pytest.raises(GroupedMMError, match="offsets: 1-D int32"):
        grouped_mm(torch.zeros(8, 16, device=device), torch.zeros(2, 16, 8, device=device), offsets)


def test_the_expert_backend_checks_its_operands(device):
    """The engine's own GEMMs go through the check: a misaligned expert weight is refused on CPU too."""
    experts = GroupedExperts(16, 8, 2, ExpertBackendKind.TORCH).to(device)
    flat = torch.zeros(experts.gate_up.numel() + 1, device=device)
    experts.gate_up.data = flat[1:].view_as(experts.gate_up)
    x = torch.randn(8, 16, device=device)
    with pytest.raises(GroupedMMError, match="data pointer"):
        experts(x, ExpertGroups.from_counts(torch.tensor([3, 5], device=device)))


@pytest.mark.parametrize("grad_dtype", ["fp32", "param"])
def test_gradient_buckets_keep_every_parameter_16_byte_aligned(grad_dtype):
    """Re-homed parameter and gradient views start on 16-byte boundaries, whatever the sizes before
    them (q/k norms of head_dim 6 in bf16 are 12 bytes), in bf16 and in fp32 gradient buffers, and a
    step still trains."""
    config = ModelConfig(
        vocab_size=64,
        d_model=24,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        seq_len=8,
        qk_norm=True,
        n_dense_layers=1,
        dense_hidden=40,
        dtype="bf16",
        moe=MoEConfig(num_experts=3, top_k=2, expert_hidden=8, routing="random"),
    )
    torch.manual_seed(SEED)
    model = build_model(config)
    opt = DataParallelOptimizer(model, None, OptimizerConfig(), shard=False, grad_dtype=grad_dtype)
    misaligned = [name for name, p in model.named_parameters() if p.data_ptr() % 16 or opt.grad_view(p).data_ptr() % 16]
    assert misaligned == []
    tokens = torch.randint(0, 64, (2, 8))
    opt.zero_grad()
    model.loss(tokens, tokens).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _garbage_for_empty_groups(real):
    """A grouped GEMM that leaves empty groups' weight-gradient slices unwritten (NaN here), as a
    kernel that skips empty groups would."""

    def grouped_mm_leaving_empty_groups(a, b, offs=None, **kwargs):
        out = real(a, b, offs=offs, **kwargs)
        if out.dim() == 3:  # a weight gradient: one (out, in) slice per group
            counts = torch.diff(offs, prepend=offs.new_zeros(1))
            out = out.clone()
            out[counts == 0] = float("nan")
        return out

    return grouped_mm_leaving_empty_groups


@pytest.mark.parametrize("backend", [ExpertBackendKind.TORCH, ExpertBackendKind.MXFP8])
def test_experts_without_tokens_get_exactly_zero_weight_gradients(backend, device, monkeypatch):
    torch.manual_seed(SEED)
    dtype = torch.bfloat16 if backend is ExpertBackendKind.MXFP8 else torch.float32
    experts = GroupedExperts(32, 32, 4, backend).to(device=device, dtype=dtype)
    reference = GroupedExperts(32, 32, 4, ExpertBackendKind.LOOP).to(device=device, dtype=dtype)
    for p, q in zip(experts.parameters(), reference.parameters()):
        torch.nn.init.normal_(p, std=0.1)
        q.data.copy_(p.data)
    counts = torch.tensor([6, 0, 10, 0], device=device)
    x = torch.randn(16, 32, device=device, dtype=dtype)
    # A kernel that leaves empty groups unwritten, on a device where the engine is told so.
    monkeypatch.setattr(torch, "_grouped_mm", _garbage_for_empty_groups(torch._grouped_mm))
    monkeypatch.setattr("moe_engine.moe.grouped_gemm.kernel_zeroes_empty_groups", lambda device: False)
    experts(x, ExpertGroups.from_counts(counts)).float().square().sum().backward()
    reference(x, ExpertGroups.from_counts(counts)).float().square().sum().backward()
    for name in ("gate_up", "down"):
        grad, want = getattr(experts, name).grad, getattr(reference, name).grad
        assert torch.equal(grad[1], torch.zeros_like(grad[1])) and torch.equal(grad[3], torch.zeros_like(grad[3]))
        # fp32: the two GEMMs over 32 and their backward, the weight gradients over up to 10 rows.
        tol = tolerance(torch.float32, 32, depth=5) if dtype == torch.float32 else 0.1
        assert torch.allclose(grad.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item()), name


def test_path_names_the_kernel(device):
    if device.type == "cpu":
        assert grouped_mm_path(device, torch.bfloat16) is GroupedMMPath.FALLBACK
        assert grouped_mm_path(device, torch.float32) is GroupedMMPath.FALLBACK
    else:
        fast = torch.cuda.get_device_capability(device)[0] in (9, 10)
        assert grouped_mm_path(device, torch.bfloat16) is (GroupedMMPath.CUTLASS if fast else GroupedMMPath.FALLBACK)
        assert grouped_mm_path(device, torch.float32) is GroupedMMPath.FALLBACK


@pytest.mark.parametrize(
    "capability, dtype, expected",
    [
        ((9, 0), torch.bfloat16, GroupedMMPath.CUTLASS),
        ((10, 0), torch.bfloat16, GroupedMMPath.CUTLASS),
        ((10, 3), torch.bfloat16, GroupedMMPath.CUTLASS),  # B300
        ((8, 0), torch.bfloat16, GroupedMMPath.FALLBACK),
        ((8, 9), torch.bfloat16, GroupedMMPath.FALLBACK),
        ((12, 0), torch.bfloat16, GroupedMMPath.FALLBACK),
        ((9, 0), torch.float32, GroupedMMPath.FALLBACK),
        ((10, 0), torch.float16, GroupedMMPath.FALLBACK),
    ],
)
def test_path_by_architecture_and_dtype(capability, dtype, expected, monkeypatch):
    """torch runs its CUTLASS grouped GEMM for bf16 on majors 9 and 10 only (faked device, no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert grouped_mm_path("cuda", dtype) is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_writes_zero_weight_gradients_for_empty_groups(dtype):
    """Why the engine skips its own zeroing on CPU: the kernel's empty groups are exact zeros."""
    from moe_engine.moe.grouped_gemm import kernel_zeroes_empty_groups

    assert kernel_zeroes_empty_groups(torch.device("cpu"))
    torch.manual_seed(SEED)
    counts = [4, 0, 6, 0]
    grad_MN, x_MK = torch.randn(10, 8).to(dtype), torch.randn(10, 16).to(dtype)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    for _ in range(3):  # fresh outputs each time: not zeros by luck of a reused buffer
        wgrad = grouped_mm(grad_MN.t(), x_MK, offsets)
        assert torch.equal(wgrad[1], torch.zeros_like(wgrad[1])) and torch.equal(wgrad[3], torch.zeros_like(wgrad[3]))
