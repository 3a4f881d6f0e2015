"""Parameter counts against built models, and FLOPs per token against hand arithmetic.

The expected numbers are written out with literals on purpose: reusing the module's helpers here
would only check that the module agrees with itself.
"""

from __future__ import annotations

import dataclasses

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from moe_engine import ModelConfig, MoEConfig, build_model
from moe_engine.config import RecomputeConfig
from moe_engine.flops import (
    ParameterCounts,
    block_forward_flops_per_token,
    forward_flops_per_token,
    hardware_flops_per_token,
    parameter_counts,
    recompute_flops_per_token,
    training_flops_per_token,
)


def dense_gqa_config() -> ModelConfig:
    """Leading dense layer, GQA (4 query heads over 2 kv heads), QK-norm, no shared expert."""
    return ModelConfig(
        vocab_size=128,
        d_model=64,
        n_layers=3,
        n_heads=4,  # head_dim 16, q_dim 64
        n_kv_heads=2,  # kv_dim 32
        seq_len=32,
        n_dense_layers=1,
        dense_hidden=96,
        qk_norm=True,
        dtype="fp32",
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32, backend="loop"),
    )


def shared_expert_config() -> ModelConfig:
    """All-MoE, sigmoid router, shared expert, no QK-norm."""
    return ModelConfig(
        vocab_size=100,
        d_model=32,
        n_layers=2,
        n_heads=2,  # head_dim 16, q_dim 32
        n_kv_heads=2,  # kv_dim 32
        seq_len=16,
        dtype="fp32",
        moe=MoEConfig(
            num_experts=6, top_k=3, expert_hidden=16, shared_expert_hidden=24, score_func="sigmoid", backend="loop"
        ),
    )


def trillion_config() -> ModelConfig:
    """Kimi-K2-like shape (~1.03T parameters): 4 TB in fp32, so it cannot be built here."""
    return ModelConfig(
        vocab_size=163840,
        d_model=7168,
        n_layers=61,
        n_heads=64,  # head_dim 112
        n_kv_heads=8,
        seq_len=4096,
        n_dense_layers=1,
        dense_hidden=18432,
        qk_norm=True,
        moe=MoEConfig(num_experts=384, top_k=8, expert_hidden=2048, shared_expert_hidden=2048),
    )


def built_numel(config: ModelConfig) -> int:
    return sum(p.numel() for p in build_model(config).parameters())


@pytest.mark.parametrize("make_config", [dense_gqa_config, shared_expert_config])
def test_total_matches_built_model(make_config):
    config = make_config()
    assert parameter_counts(config).total == built_numel(config)


def test_dense_gqa_counts_by_hand():
    counts = parameter_counts(dense_gqa_config())
    embedding = 128 * 64  # 8192
    lm_head = 64 * 128  # 8192
    attention = 3 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64)  # q, k, v, o: 3 * 12288 = 36864
    norms = 3 * (64 + 64 + 64 + 32) + 64  # attn/ffn norms, q_norm, k_norm per block; final: 736
    dense_ffn = 1 * 3 * 64 * 96  # 18432
    router = 2 * 4 * 64  # 512
    experts = 2 * 4 * 3 * 64 * 32  # 49152
    total = embedding + lm_head + attention + norms + dense_ffn + router + experts
    assert total == 122080
    # Each of the 2 MoE layers skips 4 - 2 = 2 experts of 3 * 64 * 32 = 6144 parameters.
    active = 122080 - 2 * (4 - 2) * 3 * 64 * 32
    assert active == 97504
    assert counts == ParameterCounts(
        total=122080,
        active=97504,
        embedding=8192,
        lm_head=8192,
        attention=36864,
        norms=736,
        dense_ffn=18432,
        router=512,
        shared_expert=0,
        experts=49152,
    )


def test_shared_expert_counts_by_hand():
    counts = parameter_counts(shared_expert_config())
    total = (
        100 * 32  # embedding 3200
        + 32 * 100  # lm_head 3200
        + 2 * 4 * 32 * 32  # attention 8192
        + 2 * (32 + 32)
        + 32  # norms 160
        + 2 * 6 * 32  # router 384
        + 2 * 3 * 32 * 24  # shared expert 4608
        + 2 * 6 * 3 * 32 * 16  # routed experts 18432
    )
    assert counts.total == total == 38176
    # Each of the 2 MoE layers skips 6 - 3 = 3 experts of 3 * 32 * 16 = 1536 parameters.
    assert counts.active == 38176 - 2 * (6 - 3) * 3 * 32 * 16 == 28960
    assert counts.shared_expert == 4608
    assert counts.router == 384


@pytest.mark.parametrize("make_config", [dense_gqa_config, shared_expert_config, trillion_config])
def test_components_partition_total(make_config):
    counts = parameter_counts(make_config())
    parts = {f.name: getattr(counts, f.name) for f in dataclasses.fields(counts)}
    assert parts.pop("total") == sum(v for k, v in parts.items() if k != "active")


def test_training_flops_by_hand():
    # 6 * matmul params per token + n_layers * 6 * seq_len * q_dim (QK^T and AV, causal, fwd+bwd).
    # dense_gqa: attention 3 * 12288, dense 3*64*96, 2 MoE layers * top_k 2 * 3*64*32, lm_head 64*128.
    matmul = 3 * 12288 + 3 * 64 * 96 + 2 * 2 * 3 * 64 * 32 + 64 * 128  # 88064
    expected = 6 * matmul + 3 * 6 * 2 * 32 * 64 * 0.5  # 528384 + 36864
    assert expected == 565248
    assert training_flops_per_token(dense_gqa_config()) == 565248.0

    # shared_expert: attention 2 * 4*32*32, 2 MoE layers * (top_k 3 * 3*32*16 + shared 3*32*24), lm_head 32*100.
    matmul = 2 * 4 * 32 * 32 + 2 * (3 * 3 * 32 * 16 + 3 * 32 * 24) + 32 * 100  # 25216
    expected = 6 * matmul + 2 * 6 * 2 * 16 * 32 * 0.5  # 151296 + 6144
    assert expected == 157440
    assert training_flops_per_token(shared_expert_config()) == 157440.0


def test_seq_len_only_moves_attention_term():
    config = dense_gqa_config()
    # Doubling seq_len from 32 to 64 adds n_layers * 6 * 32 * q_dim = 3 * 6 * 32 * 64.
    assert training_flops_per_token(config, seq_len=64) - training_flops_per_token(config) == 3 * 6 * 32 * 64
    assert training_flops_per_token(config, seq_len=32) == training_flops_per_token(config)
    assert forward_flops_per_token(config) == pytest.approx(565248 / 3)
    with pytest.raises(ValueError, match="seq_len"):
        training_flops_per_token(config, seq_len=0)


class _NoTensorOps(TorchDispatchMode):
    """Records every tensor op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_trillion_parameter_config_is_pure_arithmetic():
    # Building this model would need ~4 TB in fp32; the count must come from arithmetic alone.
    config = trillion_config()
    with _NoTensorOps() as ops:  # not one tensor made, so no model built, at any size
        counts = parameter_counts(config)
        flops = training_flops_per_token(config)
    assert ops.seen == []

    assert all(type(getattr(counts, f.name)) is int for f in dataclasses.fields(counts))
    assert 1.0e12 < counts.total < 1.1e12
    assert 3.0e10 < counts.active < 4.0e10  # ~32B active, as Kimi K2 reports
    assert counts.total > counts.active
    assert counts.experts > 0.95 * counts.total
    # Routed experts: 60 MoE layers * 384 experts * 3 * 7168 * 2048, exactly.
    assert counts.experts == 60 * 384 * 3 * 7168 * 2048

    assert isinstance(flops, float)
    # Matmul FLOPs are 6x the active parameters minus those that do no matmul (embedding, router,
    # norms); the attention term adds 61 * 6 * 4096 * 7168 on top.
    no_matmul = counts.embedding + counts.router + counts.norms
    assert flops == 6 * (counts.active - no_matmul) + 61 * 6 * 4096 * 7168


def test_layer_flops_of_the_micro_benchmark_shape():
    from moe_engine.flops import dense_ffn_training_flops_per_token, moe_ffn_training_flops_per_token

    moe = MoEConfig(num_experts=64, top_k=8, expert_hidden=512, shared_expert_hidden=256)
    # 6 x (8 experts x 3 matrices x 1024 x 512 + shared 3 x 1024 x 256)
    assert moe_ffn_training_flops_per_token(1024, moe) == 6 * (8 * 3 * 1024 * 512 + 3 * 1024 * 256)
    assert dense_ffn_training_flops_per_token(1024, 4096) == 6 * 3 * 1024 * 4096


# ---- recompute ----------------------------------------------------------------------------------


def recompute(mode: str = "none", parts: tuple[str, ...] = (), **subset) -> RecomputeConfig:
    return RecomputeConfig(mode=mode, parts=list(parts), **subset)


def test_recompute_flops_by_hand():
    # dense_gqa: D 64, q 64, kv 32, S 32; block 0 dense (F_dense 96), blocks 1, 2 MoE (k 2, F 32, no shared).
    # attention forward 2*(2*64*64 + 2*64*32) + 2*32*64 = 28672; the selective recompute leaves its
    # output projection out: 28672 - 2*64*64 = 20480.
    # full, dense block: 28672 + 2*3*64*96 - down 2*64*96 = 53248; MoE block (it ends with the
    # combine, nothing left out): 28672 + 2*2*3*64*32 = 53248.
    config, one_stage = dense_gqa_config(), [range(3)]
    cases = [
        (recompute(), 0),
        (recompute("full"), 3 * 53248),
        (recompute("selective", ("attention",)), 3 * 20480),
        (recompute("selective", ("experts",)), 2 * 2 * 2 * 3 * 64 * 32),  # the dense block has no routed experts
        (recompute("selective", ("norms",)), 0),
        (recompute("selective", ("attention", "experts", "norms")), 3 * 20480 + 2 * 24576),
        (recompute("full", every=2), 2 * 53248),  # blocks 0 and 2
    ]
    for rc, expected in cases:
        assert recompute_flops_per_token(config, rc, one_stage) == expected, rc
        assert hardware_flops_per_token(config, rc, one_stage) == 565248 + expected, rc
    # first_per_stage counts in each pipeline stage: stages [0, 1] and [2] -> blocks 0 and 2.
    assert recompute_flops_per_token(config, recompute("full", first_per_stage=1), [range(2), range(2, 3)]) == 2 * 53248
    assert recompute_flops_per_token(config, recompute("full", first_per_stage=1), [range(1), range(1, 3)]) == 2 * 53248
    # The attention term follows the sequence length: 2 * S * q_dim.
    attention = recompute("selective", ("attention",))
    assert recompute_flops_per_token(config, attention, one_stage, seq_len=64) - 61440 == 3 * 2 * 32 * 64

    # shared_expert: D 32, q = kv 32, S 16, 2 MoE blocks of k 3 experts of F 16 and a shared expert of 24.
    # Block forward 2*4*32*32 + 2*16*32 + 2*(3*3*32*16 + 3*32*24) = 23040, of which the full recompute
    # leaves out the shared expert's down projection, 2*32*24.
    config = shared_expert_config()
    assert recompute_flops_per_token(config, recompute("full"), [range(2)]) == 2 * (23040 - 1536)


def test_block_forwards_make_a_third_of_the_training_flops():
    for make_config in (dense_gqa_config, shared_expert_config, trillion_config):
        config = make_config()
        blocks = sum(block_forward_flops_per_token(config, i) for i in range(config.n_layers))
        assert 3 * (blocks + 2 * config.d_model * config.vocab_size) == training_flops_per_token(config)
    with pytest.raises(ValueError, match="layer_idx"):
        block_forward_flops_per_token(dense_gqa_config(), 3)


def recompute_config() -> ModelConfig:
    """A leading dense block, GQA, QK-norm and a shared expert: every kind of recomputed region. fp32,
    the grouped-GEMM experts, balanced routing (the same rows whatever the weights)."""
    return ModelConfig(
        vocab_size=128,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        seq_len=32,
        n_dense_layers=1,
        dense_hidden=96,
        qk_norm=True,
        dtype="fp32",
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32, shared_expert_hidden=48, routing="balanced"),
        # The reference step: the counts below name its ATen ops (the combine's bmm among them).
        fused_kernels=False,
    )


def counted_step_flops(rc: RecomputeConfig) -> dict[str, int]:
    """FLOPs of one forward and backward of ``recompute_config``'s model under ``rc``, by op (the
    engine's work counter: torch's formulas plus the grouped GEMM and the CPU flash attention)."""
    import torch

    from bench.run.work import GroupedMMFlops, flop_counter
    from moe_engine.recompute import apply_recompute

    config = recompute_config()
    model = build_model(config)
    apply_recompute(model.blocks, rc, [range(config.n_layers)])
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(0))
    grouped = GroupedMMFlops()
    counter = flop_counter(grouped)
    with counter:
        model.loss(tokens, tokens).backward()
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    by_op["aten._grouped_mm"] = grouped.resolve()
    return by_op


@pytest.mark.parametrize(
    "rc",
    [
        recompute("full"),
        recompute("full", every=2),
        recompute("selective", ("attention",)),
        recompute("selective", ("experts",)),
        recompute("selective", ("norms",)),
        recompute("selective", ("attention", "experts", "norms")),
    ],
    ids=lambda rc: f"{rc.mode.value}-{'+'.join(p.value for p in rc.parts) or 'blocks'}-every{rc.every}",
)
def test_recompute_flops_are_what_the_recompute_runs(rc):
    """The formula against the ops the engine runs again in backward (torch's checkpoint, early stop on).

    What the counter adds beyond the formula is what the formula's convention leaves out: attention's
    scores over the whole S x S matrix (torch's count, twice the causal half) and, in a fully
    recomputed MoE block, the router's GEMM (2 * D * E) and the combine's bmm (2 * k * D).
    """
    config = recompute_config()
    tokens = 2 * config.seq_len
    extra = {op: n - counted_step_flops(recompute()).get(op, 0) for op, n in counted_step_flops(rc).items()}
    blocks = rc.blocks([range(config.n_layers)])
    moe_blocks = [i for i in blocks if i >= config.n_dense_layers]
    attentions = len(blocks) if rc.mode.value == "full" or "attention" in {p.value for p in rc.parts} else 0
    full_moe = len(moe_blocks) if rc.mode.value == "full" else 0
    # Scores: 2 matmuls x 2 FLOPs x S x q_dim per token, the full matrix: 4 * 32 * 64.
    assert extra.get("aten._scaled_dot_product_flash_attention_for_cpu", 0) == tokens * attentions * 4 * 32 * 64
    experts = 2 * 2 * 3 * 64 * 32  # per token and MoE block
    recomputes_experts = rc.mode.value == "full" or "experts" in {p.value for p in rc.parts}
    assert extra["aten._grouped_mm"] == tokens * experts * (len(moe_blocks) if recomputes_experts else 0)
    outside = attentions * 2 * 32 * 64 + full_moe * (2 * 64 * 4 + 2 * 2 * 64)
    assert sum(extra.values()) == tokens * (recompute_flops_per_token(config, rc, [range(3)]) + outside)


# ---- multi-head latent attention, interleaved MoE blocks, tied embeddings, head_dim ----------------


def mla_config(q_lora_rank: int | None = 24) -> ModelConfig:
    """MLA (D 32, H 4, Q 24 or none, C 16, n 8, r 4, v 6), two MoE blocks."""
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        seq_len=16,
        dtype="fp32",
        mla=dict(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, backend="loop"),
    )


def interleaved_config() -> ModelConfig:
    """5 blocks: one leading dense block, then MoE every 2nd (blocks 2 and 4); head_dim 12 with D 32 and
    4 heads (not D / H); tied embeddings."""
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=5,
        n_heads=4,
        n_kv_heads=2,
        head_dim=12,
        seq_len=16,
        n_dense_layers=1,
        moe_every=2,
        dense_hidden=40,
        tie_embeddings=True,
        dtype="fp32",
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, backend="loop"),
    )


def qk_norm_per_head_config() -> ModelConfig:
    return dataclasses.replace(interleaved_config(), qk_norm=True, qk_norm_per_head=True)


@pytest.mark.parametrize(
    "make_config",
    [mla_config, lambda: mla_config(None), interleaved_config, qk_norm_per_head_config],
    ids=["mla", "mla-no-q-latent", "interleaved-tied", "qk-norm-per-head"],
)
def test_new_features_total_matches_built_model(make_config):
    config = make_config()
    assert parameter_counts(config).total == built_numel(config)


def test_per_head_qk_norm_counts_one_weight_of_head_dim_each():
    # Two block norms of 32 and q_norm, k_norm of head_dim 12 each, in 5 blocks; the final norm.
    assert parameter_counts(qk_norm_per_head_config()).norms == 5 * (64 + 2 * 12) + 32


def test_mla_counts_and_flops_by_hand():
    counts = parameter_counts(mla_config())
    # Per block: q_a 32*24 + q_b 24*(4*12) + kv_a 32*(16+4) + kv_b 16*(4*(8+6)) + o (4*6)*32
    #          = 768 + 1152 + 640 + 896 + 768 = 4224.
    assert counts.attention == 2 * 4224
    # Two block norms of 32, the query latent's 24 and the key-value latent's 16 per block; final 32.
    assert counts.norms == 2 * (64 + 24 + 16) + 32 == 240
    assert counts.total == 2048 + 2048 + 8448 + 240 + 2 * 4 * 32 + 2 * 4 * 3 * 32 * 16 == 25328
    assert counts.active == 25328 - 2 * 2 * 3 * 32 * 16 == 19184
    # Megatron's MLA terms: Q(D + H(n+r) + 1) + C(D + H(n+v) + 1) + D r + H v D
    #   = 24*81 + 16*89 + 32*4 + 24*32 = 1944 + 1424 + 128 + 768 = 4264 (the latent norms' 40 on top).
    # Core: 6 * S * (H(n+r)/2 + H v/2) = 6 * 16 * (24 + 12) = 3456 per block.
    matmul = 2 * 4264 + 2 * 2 * 3 * 32 * 16 + 32 * 64  # 16720
    assert training_flops_per_token(mla_config()) == 6 * matmul + 2 * 3456 == 107232
    # Without the query latent: q_proj 32 * 48 = 1536 replaces Q's 1944 (and its norm).
    no_q = mla_config(None)
    assert parameter_counts(no_q).attention == 2 * (1536 + 640 + 896 + 768)
    assert training_flops_per_token(no_q) == 6 * (2 * (1536 + 1424 + 128 + 768) + 6144 + 2048) + 2 * 3456
    # Selective attention recompute: its forward, 2 * 4264 + S * 72, less o_proj's 2 * 768.
    attention = RecomputeConfig(mode="selective", parts=["attention"])
    assert recompute_flops_per_token(mla_config(), attention, [range(2)]) == 2 * (2 * 4264 + 16 * 72 - 2 * 768)


def test_interleaved_tied_counts_and_flops_by_hand():
    config = interleaved_config()
    assert [config.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]
    counts = parameter_counts(config)
    assert counts.lm_head == 0  # tied: the one V x D matrix is the embedding's
    assert counts.embedding == 64 * 32
    # q_dim 4 * 12 = 48, kv_dim 2 * 12 = 24: 2*32*48 + 2*32*24 = 4608 per block.
    assert counts.attention == 5 * 4608
    assert counts.dense_ffn == 3 * 3 * 32 * 40  # blocks 0, 1 and 3
    assert counts.experts == 2 * 4 * 3 * 32 * 16
    assert counts.total == 2048 + 5 * 4608 + (5 * 64 + 32) + 11520 + 2 * 4 * 32 + 12288 == 49504
    assert counts.active == 49504 - 2 * 2 * 3 * 32 * 16
    # The LM head's matmul runs tied or not: D * V stays in the FLOPs.
    matmul = 5 * 4608 + 3 * 3 * 32 * 40 + 2 * 2 * 3 * 32 * 16 + 32 * 64  # 42752
    assert training_flops_per_token(config) == 6 * matmul + 5 * 6 * 16 * 48 == 279552
    untied = dataclasses.replace(config, tie_embeddings=False)
    assert training_flops_per_token(untied) == training_flops_per_token(config)
    assert parameter_counts(untied).total - counts.total == 32 * 64
    # Block forwards follow the pattern: dense blocks 0, 1, 3 and MoE blocks 2, 4.
    dense_block = 2 * 4608 + 16 * 96 + 2 * 3 * 32 * 40
    moe_block = 2 * 4608 + 16 * 96 + 2 * 2 * 3 * 32 * 16
    assert [block_forward_flops_per_token(config, i) for i in range(5)] == [dense_block] * 2 + [
        moe_block,
        dense_block,
        moe_block,
    ]
    # Full recompute of every block: the dense blocks leave out their down projection.
    full = RecomputeConfig(mode="full")
    assert recompute_flops_per_token(config, full, [range(5)]) == 3 * (dense_block - 2 * 32 * 40) + 2 * moe_block


@pytest.mark.parametrize("make_config", [mla_config, interleaved_config])
def test_new_features_partition_and_thirds(make_config):
    config = make_config()
    counts = parameter_counts(config)
    parts = {f.name: getattr(counts, f.name) for f in dataclasses.fields(counts)}
    assert parts.pop("total") == sum(v for k, v in parts.items() if k != "active")
    blocks = sum(block_forward_flops_per_token(config, i) for i in range(config.n_layers))
    assert 3 * (blocks + 2 * config.d_model * config.vocab_size) == training_flops_per_token(config)
