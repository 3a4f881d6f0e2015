"""What every transformers interop test checks: same logits, same loss, same gradients (fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tolerances import model_tolerance


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def perturb_norms(hf_model, scale: float = 0.2) -> None:
    """Norm weights away from 1 (transformers initialises them to ones), so a swapped or missing norm shows."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.add_(scale * torch.randn_like(param))


def assert_same_function(hf_model, model, pairs, vocab: int, seq: int = 24, tol: float = 1e-4) -> None:
    """Logits, the cross-entropy and every parameter's gradient agree. ``pairs``: (engine name,
    transformers name[, transform]) for every parameter, the conversion's own list; a transform maps
    transformers' gradient into the engine's layout as it maps the weight."""
    # The engine's router losses enter its backward; transformers' loss has none.
    model.config.moe.aux_loss_weight = 0.0
    model.config.moe.z_loss_weight = 0.0
    torch.manual_seed(2)
    tokens = torch.randint(0, vocab, (2, seq))
    labels = torch.randint(0, vocab, (2, seq))
    expected = hf_model(tokens, use_cache=False).logits
    actual = model(tokens)
    assert actual.shape == expected.shape
    assert rel_err(actual, expected) <= tol
    loss_ref = F.cross_entropy(expected.float().flatten(0, 1), labels.flatten())
    loss = model.loss(tokens, labels)
    loss_rtol = model_tolerance(model.config, tokens.numel(), gradients=False)
    torch.testing.assert_close(loss, loss_ref, rtol=loss_rtol, atol=0)
    loss_ref.backward()
    loss.backward()
    theirs = dict(hf_model.named_parameters(remove_duplicate=False))
    ours = dict(model.named_parameters())
    checked = 0
    for our_name, their_name, *transform in pairs:
        if our_name not in ours:  # a buffer (the selection bias): no gradient
            continue
        grad_ref = theirs[their_name].grad
        if transform:
            grad_ref = transform[0](grad_ref)
        assert rel_err(ours[our_name].grad, grad_ref) <= tol, our_name
        checked += 1
    assert checked == len(ours), "every engine parameter's gradient compared"
