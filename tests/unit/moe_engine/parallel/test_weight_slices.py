"""A cool-down weight backward run in slices (``pipeline._WeightSlices``) runs each weight's
post-accumulate hooks once, after the last of its parameter groups, and only where a gradient came."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from moe_engine.parallel import pipeline


def _accumulator(weight: nn.Parameter):
    return weight.view_as(weight).grad_fn.next_functions[0][0]


def _group(weights, grads):
    return {"params": {_accumulator(w) for w in weights}, "grads": [grads], "intermediates": [None]}


def test_each_weight_hooks_once_after_its_last_group_and_only_with_a_gradient(monkeypatch):
    shared, alone, idle = (nn.Parameter(torch.zeros(n)) for n in (3, 2, 4))
    module = nn.Module()
    module.shared, module.alone, module.idle = shared, alone, idle
    groups = [
        _group([shared, alone], (torch.ones(1),)),
        _group([shared], (torch.ones(1),)),
        _group([idle], (None,)),  # nothing flowed to it: torch computes nothing for the group
    ]
    stage = SimpleNamespace(
        is_first=False,
        submod=module,
        backward_state={0: (None, groups, None, None)},
        dw_runner={0: lambda: None},
    )
    hooked: list[tuple[str, int]] = []
    for name, weight in module.named_parameters():
        weight.register_post_accumulate_grad_hook(lambda w, name=name: hooked.append((name, len(ran))))
    ran: list[int] = []
    monkeypatch.setattr(pipeline, "stage_backward_weight", lambda weights, taken: ran.append(len(taken)))

    slices = pipeline._WeightSlices(stage, 0)
    slices.share = 1  # one group per slice
    for _ in range(3):
        slices._run_slice()
    slices.finish()

    assert ran == [1, 1, 1]
    # alone after the first group; shared only after the second, its last; idle never.
    assert sorted(hooked) == [("alone", 1), ("shared", 2)]
    assert stage.backward_state == {} and stage.dw_runner == {}
