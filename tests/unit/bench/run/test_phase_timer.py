import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from bench.run.phase_timer import PhaseTimer, in_backward, instrument_model
from moe_engine import ModelConfig, build_model
from moe_engine.config import MoEConfig


class FakeClock:
    """A clock that moves only when the test advances it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _Work(torch.autograd.Function):
    """Identity whose forward advances the clock by ``fwd`` and whose backward by ``bwd``."""

    @staticmethod
    def forward(ctx, x, clock, fwd, bwd):
        clock.advance(fwd)
        ctx.clock, ctx.bwd = clock, bwd
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.advance(ctx.bwd)
        return grad, None, None, None


class Leaf(nn.Module):
    def __init__(self, clock, fwd, bwd):
        super().__init__()
        self.clock, self.fwd, self.bwd = clock, fwd, bwd
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Work.apply(x * self.scale, self.clock, self.fwd, self.bwd)


class Parent(nn.Module):
    """Work before the child, the child, work after it."""

    def __init__(self, clock, child):
        super().__init__()
        self.clock, self.child = clock, child

    def forward(self, x):
        x = _Work.apply(x, self.clock, 1.0, 10.0)
        x = self.child(x)
        return _Work.apply(x, self.clock, 2.0, 20.0)


def totals_close(actual, expected):
    assert actual.keys() == expected.keys()
    for phase, by_direction in expected.items():
        for direction, seconds in by_direction.items():
            assert actual[phase][direction] == pytest.approx(seconds), (phase, direction)


def test_single_module_forward_and_backward():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    leaf = Leaf(clock, 3.0, 7.0)
    timer.instrument(leaf, "leaf")
    x = torch.randn(4, requires_grad=True)
    clock.advance(100.0)  # outside any phase: not charged
    y = leaf(x)
    clock.advance(100.0)
    y.sum().backward()
    clock.advance(100.0)
    totals_close(timer.totals, {"leaf": {"forward": 3.0, "backward": 7.0}})


def both(parent_fwd, parent_bwd, child_fwd, child_bwd):
    return {
        "parent": {"forward": parent_fwd, "backward": parent_bwd},
        "child": {"forward": child_fwd, "backward": child_bwd},
    }


def test_nested_phases_are_exclusive():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    parent = Parent(clock, Leaf(clock, 3.0, 7.0))
    timer.instrument(parent, "parent")
    timer.instrument(parent.child, "child")
    x = torch.randn(4, requires_grad=True)
    y = parent(x)
    totals_close(timer.totals, both(3.0, 0.0, 3.0, 0.0))
    y.sum().backward()
    totals_close(timer.totals, both(3.0, 30.0, 3.0, 7.0))
    assert x.grad is not None and torch.equal(x.grad, torch.ones(4))
    assert timer._stack == []

    # Totals accumulate over steps until reset.
    parent(x).sum().backward()
    totals_close(timer.totals, both(6.0, 60.0, 6.0, 14.0))
    timer.reset()
    totals_close(timer.totals, both(0.0, 0.0, 0.0, 0.0))


def test_three_levels_and_siblings():
    clock = FakeClock()
    timer = PhaseTimer(clock)

    class Siblings(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Leaf(clock, 1.0, 2.0)
            self.b = Parent(clock, Leaf(clock, 4.0, 8.0))

        def forward(self, x):
            return _Work.apply(self.b(self.a(x)), clock, 0.5, 0.25)

    model = Siblings()
    timer.instrument(model, "top")
    timer.instrument(model.a, "a")
    timer.instrument(model.b, "b")
    timer.instrument(model.b.child, "b.child")
    model(torch.randn(3, requires_grad=True)).sum().backward()
    totals_close(
        timer.totals,
        {
            "top": {"forward": 0.5, "backward": 0.25},
            "a": {"forward": 1.0, "backward": 2.0},
            "b": {"forward": 3.0, "backward": 30.0},
            "b.child": {"forward": 4.0, "backward": 8.0},
        },
    )


@dataclass
class Routed:
    index: torch.Tensor
    weight: torch.Tensor
    aux: torch.Tensor


class DataclassModule(nn.Module):
    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        weight = _Work.apply(x * self.w, self.clock, 2.0, 5.0)
        return Routed(torch.arange(4), weight, weight.sum())


def test_dataclass_output():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    module = DataclassModule(clock)
    timer.instrument(module, "router")
    x = torch.randn(4, requires_grad=True)
    out = module(x)
    assert isinstance(out, Routed)
    assert torch.equal(out.index, torch.arange(4))
    assert out.weight.grad_fn is not None and "Marker" in type(out.weight.grad_fn).__name__
    (out.weight * 3).sum().backward()
    totals_close(timer.totals, {"router": {"forward": 2.0, "backward": 5.0}})
    assert torch.equal(x.grad, torch.full((4,), 3.0))


def test_tuple_output_marks_first_tensor_requiring_grad():
    clock = FakeClock()
    timer = PhaseTimer(clock)

    class TupleModule(nn.Module):
        def forward(self, x):
            return torch.zeros(2), _Work.apply(x, clock, 1.0, 4.0), x * 2

    module = TupleModule()
    timer.instrument(module, "t")
    x = torch.randn(2, requires_grad=True)
    first, second, third = module(x)
    assert first.grad_fn is None and "Marker" in type(second.grad_fn).__name__
    assert "Marker" not in type(third.grad_fn).__name__
    second.sum().backward()
    totals_close(timer.totals, {"t": {"forward": 1.0, "backward": 4.0}})


class _BackwardRegion(torch.autograd.Function):
    """Identity whose backward runs a timed region of 6 s plus 1 s of untimed backward work."""

    @staticmethod
    def forward(ctx, x, timer, clock):
        ctx.timer, ctx.clock = timer, clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        assert in_backward()
        ctx.clock.advance(1.0)
        with ctx.timer.region("proxy"):
            ctx.clock.advance(6.0)
        return grad, None, None


def test_region_in_forward_and_backward():
    clock = FakeClock()
    timer = PhaseTimer(clock)

    class WithRegion(nn.Module):
        def forward(self, x):
            clock.advance(1.0)
            with timer.region("proxy"):
                clock.advance(4.0)
            return _BackwardRegion.apply(x * 2, timer, clock)

    module = WithRegion()
    timer.instrument(module, "layer")
    assert not in_backward()
    module(torch.randn(3, requires_grad=True)).sum().backward()
    totals_close(
        timer.totals,
        {"layer": {"forward": 1.0, "backward": 1.0}, "proxy": {"forward": 4.0, "backward": 6.0}},
    )

    with timer.region("optimizer"):
        clock.advance(0.5)
    assert timer.totals["optimizer"] == {"forward": 0.5, "backward": 0.0}


def test_remove_stops_timing():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    leaf = Leaf(clock, 3.0, 7.0)
    timer.instrument(leaf, "leaf")
    x = torch.randn(4, requires_grad=True)
    leaf(x).sum().backward()
    timer.remove()
    y = leaf(x)
    assert "Marker" not in type(y.grad_fn).__name__
    y.sum().backward()
    totals_close(timer.totals, {"leaf": {"forward": 3.0, "backward": 7.0}})


def test_no_grad_times_forward_only():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    parent = Parent(clock, Leaf(clock, 3.0, 7.0))
    timer.instrument(parent, "parent")
    timer.instrument(parent.child, "child")
    with torch.no_grad():
        y = parent(torch.randn(4, requires_grad=True))
    assert y.grad_fn is None
    totals_close(timer.totals, both(3.0, 0.0, 3.0, 0.0))


def test_input_without_grad_gets_no_backward_markers():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    leaf = Leaf(clock, 3.0, 7.0)
    timer.instrument(leaf, "leaf")
    y = leaf(torch.randn(4))  # only the parameter requires grad: nothing would close the phase
    assert "Marker" not in type(y.grad_fn).__name__
    y.sum().backward()
    totals_close(timer.totals, {"leaf": {"forward": 3.0, "backward": 0.0}})


def test_out_of_order_and_unknown_exits():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    timer._enter("a", "forward")
    clock.advance(1.0)
    timer._enter("b", "forward")
    clock.advance(2.0)
    timer._exit("a", "forward")  # not on top: b is charged, a leaves the stack
    clock.advance(3.0)
    timer._exit("zzz", "forward")  # not open: ignored
    timer._exit("b", "forward")
    clock.advance(4.0)  # empty stack: not charged
    totals_close(timer.totals, {"a": {"forward": 1.0, "backward": 0.0}, "b": {"forward": 5.0, "backward": 0.0}})
    assert timer._stack == []


def test_partial_backward_closes_open_phases():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    parent = Parent(clock, Leaf(clock, 3.0, 7.0))
    timer.instrument(parent.child, "child")
    x = torch.randn(4, requires_grad=True)
    open_during_backward = []

    def spy(grad):
        open_during_backward.append([entry.phase for entry in timer._stack])

    handle = parent.child.scale.register_hook(spy)
    y = parent(x)
    # Gradient w.r.t. the child's parameter only: autograd enters the child at its output marker
    # but never runs its input marker; the phase is closed when the backward pass ends.
    torch.autograd.grad(y.sum(), parent.child.scale)
    assert open_during_backward == [["child"]]
    assert timer._stack == []
    totals_close(timer.totals, {"child": {"forward": 3.0, "backward": 7.0}})
    handle.remove()

    # The next, complete step is unaffected.
    timer.reset()
    parent(x).sum().backward()
    totals_close(timer.totals, {"child": {"forward": 3.0, "backward": 7.0}})


def test_module_called_twice_per_forward():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    leaf = Leaf(clock, 3.0, 7.0)
    timer.instrument(leaf, "leaf")
    x = torch.randn(4, requires_grad=True)
    leaf(leaf(x)).sum().backward()
    totals_close(timer.totals, {"leaf": {"forward": 6.0, "backward": 14.0}})
    assert timer._stack == []


def tiny_model_config(dtype: str = "fp32") -> ModelConfig:
    # Layer 0 dense (dense_ffn), layer 1 MoE with a shared expert.
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        seq_len=16,
        n_dense_layers=1,
        dense_hidden=48,
        dtype=dtype,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24, shared_expert_hidden=16),
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_model_phases_and_unchanged_numerics(dtype):
    config = tiny_model_config(dtype)
    plain = build_model(config, seed=3)
    timed = copy.deepcopy(plain)
    timer = PhaseTimer()
    instrument_model(timer, timed)

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=generator)
    labels = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=generator)
    losses = []
    for model in (plain, timed):
        loss = model.loss(tokens, labels)
        loss.backward()
        losses.append(loss)

    assert torch.equal(losses[0], losses[1])
    for (name, p_plain), (_, p_timed) in zip(plain.named_parameters(), timed.named_parameters()):
        assert p_plain.grad is not None, name
        assert torch.equal(p_plain.grad, p_timed.grad), name

    totals = timer.totals
    expected = {"block", "attention", "router", "experts", "dispatch", "shared_expert", "dense_ffn"}
    assert set(totals) == expected
    for phase in expected:
        assert totals[phase]["forward"] > 0, phase
        assert totals[phase]["backward"] > 0, phase
    assert timer._stack == []

    # Evaluation: forward only, nothing left open.
    timer.reset()
    with torch.no_grad():
        timed(tokens)
    assert all(t["forward"] > 0 and t["backward"] == 0 for t in timer.totals.values())
    assert timer._stack == []

    timer.remove()
    timer.reset()
    logits = timed(tokens)
    assert timer.totals == {phase: {"forward": 0.0, "backward": 0.0} for phase in expected}
    assert "Marker" not in type(logits.grad_fn).__name__


def test_an_open_ended_phase_times_backward_until_the_pass_ends():
    # Like a token embedding: the input takes no gradient, so only an open-ended phase has a backward
    # bracket, from its output's marker to the end of the pass (closing work after it included).
    clock = FakeClock()

    class Source(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, ids):
            return _Work.apply(ids.float() * self.scale, clock, 1.0, 10.0)

    for open_ended, expected in ((True, 10.0), (False, 0.0)):
        clock.now = 0.0
        timer = PhaseTimer(clock=clock)
        source, leaf = Source(), Leaf(clock, 2.0, 20.0)
        timer.instrument(source, "source", open_ended=open_ended)
        timer.instrument(leaf, "leaf")
        leaf(source(torch.arange(3))).sum().backward()
        totals_close(
            timer.totals,
            {
                "source": {"forward": 1.0, "backward": expected},
                "leaf": {"forward": 2.0, "backward": 20.0},
            },
        )
