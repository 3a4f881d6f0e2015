"""``GQA``: a small MoE model config with every module kind that takes the fused kernels' switch (a dense
first block, qk-norm, a shared expert), for the tests of the components a built model chooses."""

from moe_engine.config import ModelConfig, MoEConfig

# A dense first block, qk-norm, a shared expert: every module kind that takes the switch.
GQA = ModelConfig(
    vocab_size=64,
    d_model=16,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    seq_len=8,
    n_dense_layers=1,
    dense_hidden=24,
    qk_norm=True,
    dtype="fp32",
    moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=12, shared_expert_hidden=8),
)
