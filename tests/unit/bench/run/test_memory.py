"""TensorMemoryTracker: exact live and peak bytes for known patterns of allocations, views, updates and autograd.

Every expected figure is elements x bytes per element, written out: float32 4, float64 8, bfloat16 2,
int16 2, int64 8.
"""

from __future__ import annotations

import torch

from bench.run.memory import TensorMemoryTracker


def randn(*shape: int, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), requires_grad=requires_grad)


def test_an_allocation_counts_its_storage_bytes():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(3, 5)
        assert (tracker.current, tracker.peak) == (3 * 5 * 4, 3 * 5 * 4)
        b = torch.zeros(7, dtype=torch.bfloat16)
        c = torch.ones(2, 3, dtype=torch.int64)
        d = torch.arange(4)  # int64
        assert tracker.current == tracker.peak == 3 * 5 * 4 + 7 * 2 + 2 * 3 * 8 + 4 * 8
        assert [t.nbytes for t in (a, b, c, d)] == [60, 14, 48, 32]
    assert tracker.baseline == 0


def test_tensors_made_from_python_data_are_counted():
    with TensorMemoryTracker() as tracker:
        a = torch.tensor([1.0, 2.0, 3.0])  # float32
        b = torch.as_tensor([1, 2])  # int64
        assert tracker.current == 3 * 4 + 2 * 8
    del a, b


def test_freeing_drops_exactly_its_bytes_and_keeps_the_peak():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(4, 8)
        b = torch.empty(16, dtype=torch.float64)
        c = torch.empty(10, dtype=torch.int16)
        assert tracker.current == tracker.peak == 4 * 8 * 4 + 16 * 8 + 10 * 2
        del b  # no op runs between the del and the reading
        assert tracker.current == 4 * 8 * 4 + 10 * 2
        assert tracker.peak == 4 * 8 * 4 + 16 * 8 + 10 * 2
        del a, c
        assert tracker.current == 0
        d = torch.empty(50)  # below the peak
        assert (tracker.current, tracker.peak) == (50 * 4, 4 * 8 * 4 + 16 * 8 + 10 * 2)
        e = torch.empty(30)  # above it
        assert tracker.current == tracker.peak == 50 * 4 + 30 * 4
    del d, e


def test_views_add_no_bytes_and_keep_their_base_storage_alive():
    with TensorMemoryTracker() as tracker:
        base = torch.empty(4, 6)
        views = [
            base.view(24),
            base[1:3],
            base[:, ::2],
            base.t(),
            base.transpose(0, 1),
            base.permute(1, 0),
            base.reshape(6, 4),
            base.flatten(),
            base.unsqueeze(0),
            base.unsqueeze(0).expand(3, 4, 6),
            base.select(0, 2),
            base.narrow(1, 1, 2),
            base.as_strided((2, 2), (1, 1)),
            base.detach(),
            base.view(torch.int32),
            *base.split(2),
            *base.unbind(0),
            *base.chunk(3, dim=1),
        ]
        assert tracker.current == tracker.peak == 4 * 6 * 4
        slice_ = views[1]
        del base, views
        # The slice holds 2 x 6 elements, but the whole storage stays alive and is what counts.
        assert slice_.nbytes == 2 * 6 * 4
        assert tracker.current == 4 * 6 * 4
        del slice_
        assert tracker.current == 0
        assert tracker.peak == 4 * 6 * 4


def test_in_place_ops_add_no_bytes():
    with TensorMemoryTracker() as tracker:
        a = torch.zeros(8, 8)
        b = torch.ones(8, 8)
        a.add_(b)
        a.mul_(2)
        a.clamp_(max=1)
        a.t().sub_(b)
        a[2:4].fill_(3)
        a.copy_(b)
        a.zero_()
        torch.add(a, b, out=a)  # out= into a tensor of the result's size
        assert tracker.current == tracker.peak == 2 * 8 * 8 * 4


def test_in_place_ops_on_resident_tensors_add_no_bytes():
    weight = torch.zeros(10, 10)
    grad = torch.ones(10, 10)
    with TensorMemoryTracker([weight, grad]) as tracker:
        weight.add_(grad, alpha=-0.1)
        weight[0].mul_(2)
        grad.zero_()
        assert tracker.baseline == tracker.current == tracker.peak == 2 * 10 * 10 * 4


def test_an_out_of_place_op_adds_exactly_its_outputs():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(4, 8)
        w = torch.empty(8, 3)
        live = 4 * 8 * 4 + 8 * 3 * 4
        b = a + 1
        live += 4 * 8 * 4
        assert tracker.current == live
        c = a @ w
        live += 4 * 3 * 4
        assert tracker.current == live
        d = a.double()
        live += 4 * 8 * 8
        assert tracker.current == live
        s = a.sum()
        live += 4
        assert tracker.current == live
        values, indices = a.flatten().sort()  # two new storages: float32 values, int64 indices
        live += 32 * 4 + 32 * 8
        assert tracker.current == tracker.peak == live
    del b, c, d, s, values, indices


def test_a_reshape_that_must_copy_and_contiguous_on_a_transpose_add_a_copy():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(4, 6)
        at = a.t()
        assert tracker.current == 4 * 6 * 4
        flat = at.reshape(24)  # a transpose cannot be flattened as a view
        assert tracker.current == 2 * 4 * 6 * 4
        c = at.contiguous()
        assert tracker.current == 3 * 4 * 6 * 4
        same = a.contiguous()  # already contiguous: the tensor itself
        assert same is a and tracker.current == tracker.peak == 3 * 4 * 6 * 4
    del flat, c


def test_growing_a_storage_in_place_adds_the_growth():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(4, 8)
        out = torch.empty(0)
        assert tracker.current == 4 * 8 * 4
        torch.add(a, a, out=out)  # out= resizes the empty tensor to the result
        assert tracker.current == 2 * 4 * 8 * 4
        torch.mul(a, 2, out=out)  # the same size again: nothing new
        assert tracker.current == 2 * 4 * 8 * 4
        out.resize_(64)  # 64 float32 in place of 32
        assert tracker.current == tracker.peak == 4 * 8 * 4 + 64 * 4
        del out
        assert tracker.current == 4 * 8 * 4


def test_resident_storages_are_counted_once_and_meta_tensors_not_at_all():
    p = torch.zeros(10, 10)
    g = torch.zeros(5, dtype=torch.bfloat16)
    meta = torch.empty(1000, device="meta")
    with TensorMemoryTracker([p, p[0], p.t(), g, meta]) as tracker:
        assert tracker.baseline == tracker.current == tracker.peak == 10 * 10 * 4 + 5 * 2
        q = p * 2
        m = meta * 2  # no memory
        assert tracker.current == 2 * 10 * 10 * 4 + 5 * 2
        del q
        assert tracker.current == tracker.baseline
    del m


def test_storages_from_before_the_block_that_are_not_resident_are_not_counted():
    before = torch.zeros(100)
    with TensorMemoryTracker() as tracker:
        view = before.view(10, 10)
        before[:5].add_(1)
        before.add_(1)
        torch.add(before, 1, out=before)
        assert tracker.current == tracker.peak == 0
        new = before * 2
        assert tracker.current == 100 * 4
    del view, new


def test_a_saved_intermediate_lives_until_backward_frees_it():
    x = randn(16, 16, requires_grad=True)  # 1024 bytes, resident
    with TensorMemoryTracker([x]) as tracker:
        # exp saves its output e for backward (so does sin, its input: the same e); sin's output s is saved
        # by nobody (sum keeps only the shape) and goes when sum has read it.
        loss = x.exp().sin().sum()
        # Peak at the end of sum: x, e, s and the loss (4 bytes).
        assert tracker.peak == 1024 + 1024 + 1024 + 4
        # After forward: x, e (saved) and the loss.
        assert tracker.current == 1024 + 1024 + 4
        tracker.peak = tracker.current
        loss.backward()
        # At the end of sin's backward: x, e, the loss, the seed gradient (4 bytes, behind sum's expanded
        # gradient), cos(e) and grad * cos(e); exp's backward then makes x's gradient once cos(e) is gone.
        assert tracker.peak == 4 * 1024 + 4 + 4
        # After backward: e is freed with the graph; x, its gradient and the loss remain.
        assert tracker.current == 1024 + 1024 + 4
        assert x.grad is not None and x.grad.untyped_storage().nbytes() == 1024
        del loss
        assert tracker.current == 1024 + 1024


def test_an_activation_nobody_saves_is_freed_right_after_use():
    x = randn(16, 16, requires_grad=True)
    with TensorMemoryTracker([x]) as tracker:
        loss = (x * 2).sum()  # the product is not saved: mul by a number keeps the number, sum the shape
        assert tracker.peak == 1024 + 1024 + 4
        assert tracker.current == 1024 + 4
    with TensorMemoryTracker([x]) as tracker, torch.no_grad():
        total = x.exp().sum()
        assert (tracker.peak, tracker.current) == (1024 + 1024 + 4, 1024 + 4)
    del loss, total


def test_the_peak_can_be_lowered_to_measure_a_part():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(100)
        assert tracker.peak == 100 * 4
        del a
        tracker.peak = tracker.current  # the freed 400 bytes are not live any more
        assert tracker.peak == 0
        b = torch.empty(10)
        assert tracker.peak == 10 * 4
    del b


def test_nothing_is_tracked_outside_the_block():
    with TensorMemoryTracker() as tracker:
        a = torch.empty(10)
    b = torch.empty(1000)
    assert (tracker.current, tracker.peak) == (10 * 4, 10 * 4)
    del a, b
