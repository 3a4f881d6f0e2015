import math

import pytest
import torch
from tolerances import assert_close_to_scale, tolerance

from moe_engine import ModelConfig, build_model
from moe_engine.config import MoEConfig
from moe_engine.modules.attention import Attention
from moe_engine.modules.rope import RotaryEmbedding
from moe_engine.train import MasterWeightAdamW, OptimizerConfig, Trainer


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=96,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        seq_len=32,
        n_dense_layers=1,
        dense_hidden=96,
        dtype="fp32",
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, shared_expert_hidden=32),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def reference_attention(attn: Attention, x_BSD: torch.Tensor, theta: float) -> torch.Tensor:
    """Written from the definitions: per-head loops, explicit causal softmax, complex-number RoPE (on the CPU)."""
    batch, seq, _ = x_BSD.shape
    hd, heads, kv_heads = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q = attn.q_proj(x_BSD).view(batch, seq, heads, hd)
    k = attn.k_proj(x_BSD).view(batch, seq, kv_heads, hd)
    v = attn.v_proj(x_BSD).view(batch, seq, kv_heads, hd)

    def rope(t):  # rotate-half convention: pairs are (i, i + hd/2)
        freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angle = torch.arange(seq, dtype=torch.float64)[:, None] * freqs[None]
        z = (
            torch.complex(t[..., : hd // 2].double(), t[..., hd // 2 :].double())
            * torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
        )
        return torch.cat([z.real, z.imag], dim=-1).to(t.dtype)

    q, k = rope(q), rope(k)
    out = torch.zeros(batch, seq, heads, hd)
    mask = torch.ones(seq, seq).tril().bool()
    for h in range(heads):
        g = h // (heads // kv_heads)
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[:, :, h] = scores.softmax(-1) @ v[:, :, g]
    return attn.o_proj(out.reshape(batch, seq, -1))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_matches_definition(kv_heads, device):
    torch.manual_seed(0)
    config = tiny_config(n_kv_heads=kv_heads)
    attn = Attention(config)
    x = torch.randn(2, 12, config.d_model)
    expected = reference_attention(attn, x, config.rope_theta)
    rope = RotaryEmbedding(config.head_dim, config.seq_len, config.rope_theta).to(device)
    actual = attn.to(device)(x.to(device), rope)
    # Five reductions (projection, scores, softmax, values, output projection), the longest over d_model.
    assert_close_to_scale(actual.cpu(), expected, tolerance(torch.float32, config.d_model, depth=5))


def test_model_structure_follows_config(device):
    model = build_model(tiny_config(), device)
    assert type(model.blocks[0].ffn).__name__ == "SwiGLU"
    assert all(type(b.ffn).__name__ == "MoELayer" for b in model.blocks[1:])
    assert model.blocks[1].ffn.shared_expert is not None
    logits = model(torch.randint(0, 96, (2, 16), device=device))
    assert logits.shape == (2, 16, 96) and logits.device.type == device.type


def test_bf16_model_keeps_router_in_fp32(device):
    model = build_model(tiny_config(dtype="bf16"), device)
    for name, param in model.named_parameters():
        expected = torch.float32 if ".router." in name else torch.bfloat16
        assert param.dtype == expected, name
    assert model(torch.randint(0, 96, (1, 8), device=device)).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["torch", "mxfp8"])
def test_model_cast_with_module_to_bf16(backend, device):
    """A whole model cast with ``nn.Module.to(bf16)`` trains: every router scores in fp32 from its
    bf16 weight (checked against the softmax written out in fp32 on the router's actual input), and
    every parameter gets a bf16 gradient."""
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=32, shared_expert_hidden=32, backend=backend)
    model = build_model(tiny_config(moe=moe), device).to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    routed = []
    for layer in model.moe_layers():
        layer.router.register_forward_hook(lambda router, args, out: routed.append((router, args[0].detach(), out)))
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3)).to(device)
    loss = model.loss(tokens, tokens.roll(-1, dims=1))
    loss.backward()

    assert math.isfinite(loss.item()) and len(routed) == len(model.moe_layers()) == 2
    for router, x_TD, out in routed:
        scores_TE = torch.softmax(x_TD.float() @ router.weight.detach().float().T, dim=-1)
        top = scores_TE.topk(2, dim=-1)
        assert torch.equal(out.expert_TK, top.indices)
        # Both sum the same fp32 products over d_model, perhaps in another order, then take a softmax;
        # scores computed from bf16 values would be off by 2^-8.
        assert_close_to_scale(out.weight_TK, top.values, tolerance(torch.float32, 64, depth=2))
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name


def test_causality(device):
    config = tiny_config(moe=MoEConfig(num_experts=4, top_k=1, expert_hidden=16, routing="balanced"))
    model = build_model(config, device)
    tokens = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(4)).to(device)
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 96
    # Balanced routing depends on token position only, so earlier positions must be untouched: up to
    # rounding, should a kernel block its sums by the whole sequence (about five reductions a block).
    tol = tolerance(torch.float32, max(config.d_model, config.dense_hidden), depth=5 * config.n_layers)
    assert_close_to_scale(model(changed)[0, :10], model(tokens)[0, :10], tol)
    assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_model_learns_a_fixed_batch(dtype, device):
    config = tiny_config(dtype=dtype)
    model = build_model(config, device, seed=1)
    trainer = Trainer(model, OptimizerConfig(lr=3e-3, weight_decay=0.0))
    torch.manual_seed(2)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_len)).to(device)
    labels = tokens.roll(-1, dims=1)
    losses = [trainer.step(tokens, labels).item() for _ in range(50)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(config.vocab_size), rel=0.1)
    assert losses[-1] < 0.5 * losses[0], losses


def test_master_weights_accumulate_updates_too_small_for_bf16(device):
    """Ten updates of 1e-4 on a weight of 1.0 vanish in bf16 arithmetic but not with fp32 masters."""
    param = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16, device=device))
    optimizer = MasterWeightAdamW([param], OptimizerConfig(lr=1e-4, weight_decay=0.0))
    for _ in range(10):
        param.grad = torch.ones_like(param)
        optimizer.step()
    (master,) = optimizer.masters
    assert master.dtype == torch.float32
    assert master[0, 0].item() == pytest.approx(1 - 10e-4, rel=1e-4)
    assert torch.equal(param, master.to(torch.bfloat16))
    # masters (4 bytes) plus two Adam moments (4 bytes each) per element
    assert optimizer.state_bytes() == 16 * 12


def test_fp32_params_are_their_own_masters(device):
    model = build_model(tiny_config(), device)
    optimizer = MasterWeightAdamW(model.parameters(), OptimizerConfig())
    assert all(m is p for m, p in zip(optimizer.masters, optimizer.params))


def test_router_loss_is_part_of_the_objective(device):
    def model_with(z_loss_weight):
        moe = MoEConfig(num_experts=4, top_k=1, expert_hidden=16, aux_loss_weight=0.0, z_loss_weight=z_loss_weight)
        return build_model(tiny_config(moe=moe), device)

    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5)).to(device)
    plain, with_z = model_with(0.0), model_with(1.0)
    last_router = with_z.blocks[-1].ffn.router
    router_inputs = []
    last_router.register_forward_hook(lambda module, args, out: router_inputs.append(args[0].detach()))
    plain.loss(tokens, tokens).backward()
    with_z.loss(tokens, tokens).backward()

    # Nothing after the last router has a router loss, so its gradient differs by its own z-loss only.
    weight = last_router.weight.detach().clone().requires_grad_()
    z = torch.logsumexp(router_inputs[0] @ weight.T, dim=-1).square().mean()
    z.backward()
    expected = plain.blocks[-1].ffn.router.weight.grad + weight.grad
    # The same values summed in other orders: logits over d_model, their logsumexp, the weight gradient
    # over the 32 tokens (the engine adds the two logit gradients before that sum, the test after).
    assert_close_to_scale(last_router.weight.grad, expected, tolerance(torch.float32, 64, depth=3))
    assert plain.router_loss().item() == 0.0
    assert with_z.router_loss().item() > 0
