"""The plan's activation formulas against the tensors a real model keeps for backward, in every recompute mode,
and its per-rank memory against a real training step's peak.

A small model runs one microbatch forward under a dispatch mode that notes every storage an op
creates; what is still alive after the forward (the loss aside) is what autograd and the
checkpoints keep for backward. The plan of the same scenario (dp = ep = pp = 1, one microbatch)
must name exactly those bytes: ``activations_per_microbatch_bytes``. In backward, each recompute
brings back what its forward saves again; the largest such set must be the plan's
``recompute_peak``.

The plan leaves out what is small next to a (T, D) activation, and so does this check (``_ignored``):
integer and boolean tensors (routing indices, offsets, counts, masks), tensors of at most k values
per token (norm statistics, the z-loss's log-sum-exp, the combine weights, losses) and RoPE's
(S, head_dim) (or MLA's (S, qk_rope_head_dim)) cos/sin tables. The model is sized so that everything the plan counts is at least
four times larger than that (the smallest, attention's log-sum-exp, has H = 8 values per token).

A whole training step (the engine's trainer, fp32 gradient buffers, 4 microbatches) then peaks in
the backward of a block, where a recompute's transient meets the experts' backward: the plan's
state + activations + backward workspace must meet that peak, short of it only by the small tensors
above and the activations' gradients.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import set_checkpoint_early_stop

from bench.predict.plan import plan_scenario
from bench.run.execute import TokenBatches, build_trainer
from bench.run.memory import TensorMemoryTracker
from bench.scenario import scenario_from_dict
from moe_engine.model import build_model
from moe_engine.moe.layer import MoELayer
from moe_engine.recompute import apply_recompute

BATCH, SEQ = 2, 32
TOKENS = BATCH * SEQ
TOP_K = 2
HEAD_DIM = 32
ROPE_DIM = 16
"""RoPE width of the MLA models (their cos/sin tables are (S, ROPE_DIM))."""
MLA = {"q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": ROPE_DIM, "v_head_dim": 24}
"""DeepSeek's proportions: values narrower than queries and keys (padded to their width for the kernel)."""


class LiveStorages(TorchDispatchMode):
    """Every storage an op creates while active (not views of, or updates to, older ones), by a weak reference."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int, tuple[int, ...], torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            # A freed storage's address can be reused: a key whose storage died names a new one.
            if key in inputs or (key in self.made and not self.made[key][0].expired()):
                continue
            self.made[key] = (StorageWeakRef(storage), storage.nbytes(), tuple(t.shape), t.dtype)
        return out

    def alive(self, since: set[int] = frozenset(), excluding: tuple[torch.Tensor, ...] = ()) -> dict[int, tuple]:
        """The storages made (after the keys in ``since``) that are still alive, less ``excluding``'s."""
        skip = {t.untyped_storage()._cdata for t in excluding}
        return {k: v for k, v in self.made.items() if not v[0].expired() and k not in since and k not in skip}


def _ignored(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """What the plan leaves out (see the module docstring)."""
    numel = 1
    for n in shape:
        numel *= n
    return (
        dtype in (torch.int64, torch.int32, torch.bool)
        or numel <= TOP_K * TOKENS
        or shape in ((SEQ, HEAD_DIM), (SEQ, ROPE_DIM))
    )


def _bytes(storages: dict[int, tuple]) -> int:
    return sum(nbytes for _, nbytes, shape, dtype in storages.values() if not _ignored(shape, dtype))


def spec(
    precision: str,
    recompute: dict,
    *,
    shared: int = 0,
    dense_layers: int = 0,
    kv_heads: int = 8,
    model: dict | None = None,
) -> dict:
    return {
        "schema_version": 1,
        "name": "saved",
        "mode": "plan",
        "model": {
            "vocab_size": 128,
            "d_model": 256,
            "n_layers": 3,
            "n_heads": 8,
            "n_kv_heads": kv_heads,
            "seq_len": SEQ,
            "qk_norm": True,
            "n_dense_layers": dense_layers,
            "dense_hidden": 192,
            "moe": {"num_experts": 16, "top_k": TOP_K, "expert_hidden": 64, "shared_expert_hidden": shared},
            # The reference (unfused) step unless a case asks for the fused kernels: both are checked.
            "fused_kernels": False,
            **(model or {}),
        },
        "routing": {"mode": "random", "seed": 0},
        "precision": precision,
        "parallel": {"dp": 1, "ep": 1, "pp": 1, "microbatches": 1},
        "recompute": recompute,
        "run": {"tokens_per_step": TOKENS},
        "cluster": {"gpus": 1, "gpu_memory_gib": 1, "peak_tflops": 1},
    }


def measure(scenario, device: str = "cpu") -> tuple[int, int]:
    """(bytes kept from forward to backward, most bytes one recompute brings back) of one microbatch."""
    model = build_model(scenario.model, device)
    live = LiveStorages()
    in_backward = False
    brought_back = [0]

    def noting(forward):
        # Inside the checkpoint (wrapped before apply_recompute): its second call is the recompute.
        @functools.wraps(forward)
        def run(*args, **kwargs):
            if not in_backward:
                return forward(*args, **kwargs)
            before = set(live.alive())
            out = forward(*args, **kwargs)
            again = live.alive(
                since=before, excluding=tuple(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            )
            brought_back[0] = max(brought_back[0], _bytes(again))
            return out

        return run

    for block in model.blocks:
        experts = [block.ffn.experts] if isinstance(block.ffn, MoELayer) else []
        for module in (block, block.attn, block.attn_norm, block.ffn_norm, *experts):
            module.forward = noting(module.forward)
    apply_recompute(model.blocks, scenario.recompute, [range(len(model.blocks))])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, scenario.model.vocab_size, (BATCH, SEQ), generator=generator).to(device)
    labels = torch.randint(0, scenario.model.vocab_size, (BATCH, SEQ), generator=generator).to(device)
    # Without early stop a recompute runs its whole forward, and its re-saved tensors are all alive
    # when it returns (an early stop unwinds it by an exception, whose traceback holds the rest).
    with live, set_checkpoint_early_stop(False):
        loss = model.loss(tokens, labels)
        kept = _bytes(live.alive(excluding=(loss,)))
        in_backward = True
        loss.backward()
    return kept, brought_back[0]


def planned(scenario) -> tuple[float, float]:
    _, details = plan_scenario(scenario)
    rank = details["per_rank"]
    return rank["activations_per_microbatch_bytes"], rank["memory_bytes"]["recompute_peak"]


MODES = {
    "none": {},
    "full": {"mode": "full"},
    "attention": {"mode": "selective", "parts": ["attention"]},
    "experts": {"mode": "selective", "parts": ["experts"]},
    "norms": {"mode": "selective", "parts": ["norms"]},
    "all-parts": {"mode": "selective", "parts": ["attention", "experts", "norms"]},
    "full-every-2": {"mode": "full", "every": 2},
}
MODELS = {
    # bf16, GQA (8 query heads over 4 kv heads), no shared expert: nothing but the router reads the
    # MoE norm's output, and the router copies it to fp32.
    "bf16-gqa": {"precision": "bf16", "kv_heads": 4},
    # A shared expert saves that output; a leading dense block recomputes no experts.
    "bf16-shared-dense": {"precision": "bf16", "shared": 96, "dense_layers": 1},
    # fp32: norms save their inputs themselves, the router saves the norm's output.
    "fp32-shared": {"precision": "fp32", "shared": 96},
    # mxfp8: the experts save fp8 copies; their recompute keeps the bf16 token rows.
    "mxfp8": {"precision": "mxfp8"},
    # MLA with a query latent, values padded to the query/key width for the kernel.
    "bf16-mla": {"precision": "bf16", "model": {"qk_norm": False, "mla": MLA}},
    # fp32 MLA without a query latent, values as wide as queries (no padding: v is a view of kv_b's
    # output); the latent's norm saves its input, a view that holds the RoPE key too.
    "fp32-mla-no-q-latent": {
        "precision": "fp32",
        "model": {"qk_norm": False, "mla": {**MLA, "q_lora_rank": None, "qk_nope_head_dim": 16, "v_head_dim": 32}},
    },
    # Per-head QK-norm (Qwen3): the norms save as many bytes as over the whole projections; fp32,
    # where they save their input, a view of the projection, itself.
    "fp32-qk-norm-per-head": {"precision": "fp32", "kv_heads": 4, "model": {"qk_norm_per_head": True}},
    # Interleaved: MoE every second block (block 1), dense blocks 0 and 2, a shared expert.
    "bf16-interleaved": {"precision": "bf16", "shared": 96, "model": {"moe_every": 2}},
    # Fused kernels: norms keep their inputs as they are, SwiGLU no silu(gate), the combine its input
    # buffer, the loss no logits.
    "bf16-gqa-fused": {"precision": "bf16", "kv_heads": 4, "model": {"fused_kernels": True}},
    "fp32-shared-dense-fused": {"precision": "fp32", "shared": 96, "dense_layers": 1, "model": {"fused_kernels": True}},
    "bf16-mla-fused": {"precision": "bf16", "model": {"qk_norm": False, "mla": MLA, "fused_kernels": True}},
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_plan_names_the_bytes_a_real_model_keeps(model, mode):
    options = dict(MODELS[model])
    scenario = scenario_from_dict(spec(options.pop("precision"), MODES[mode], **options))
    kept, brought_back = measure(scenario)
    plan_kept, plan_peak = planned(scenario)
    assert kept == plan_kept
    assert brought_back == plan_peak
    if mode == "none":
        assert brought_back == 0
        return
    none, _ = measure(scenario_from_dict(spec(MODELS[model]["precision"], {}, **options)))
    if (model, mode) == ("mxfp8", "experts"):
        # The checkpoint keeps the token rows the experts gather from, in bf16, 2D bytes a token, where
        # the experts saved (D + 2F)(1 + 1/32) in fp8 for each of a token's k rows: 17,920 bytes less a
        # block at this model's F = D / 4.
        assert kept - none == 3 * TOKENS * (2 * 256 - TOP_K * (256 + 2 * 64) * 33 / 32)  # 3 MoE blocks
    elif model.endswith("-fused") and mode == "norms":
        # A fused norm keeps only its input, which its checkpoint keeps too: recomputing it saves nothing.
        assert kept == none
    else:
        assert kept < none


@pytest.mark.cuda
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("model", ["bf16-gqa", "bf16-shared-dense", "bf16-mla"])
def test_plan_names_the_bytes_a_cuda_model_keeps(model, mode):
    """The same on a GPU, where the CUDA attention kernels and grouped GEMMs save the tensors (bf16:
    the CUDA kernels that take it; fp32 attention would fall back to the math kernel)."""
    options = dict(MODELS[model])
    scenario = scenario_from_dict(spec(options.pop("precision"), MODES[mode], **options))
    assert measure(scenario, "cuda") == planned(scenario)


def test_the_check_sees_what_it_is_meant_to():
    """The measurement is not vacuous: a block keeps most of a microbatch's bytes, and full recompute
    leaves each block its (T, D) input alone."""
    kept, _ = measure(scenario_from_dict(spec("bf16", {})))
    full, _ = measure(scenario_from_dict(spec("bf16", {"mode": "full"})))
    # 3 blocks' bf16 inputs remain, next to what the LM head and loss keep.
    head = TOKENS * 256 * (4 + 2) + 2 * TOKENS * 256 + 4 * TOKENS * 128
    assert full == 3 * 2 * TOKENS * 256 + head
    assert kept > 5 * full


def step_peak(scenario) -> tuple[int, int]:
    """(resident bytes, peak bytes of the forward and backward) of one training step after a warm-up
    step (so the optimizer state exists), on CPU."""
    device = torch.device("cpu")
    _, trainer = build_trainer(scenario, None, device)
    batches = TokenBatches(scenario, device)
    trainer.step(*next(batches))
    optimizer_step, peak = trainer.optimizer.step, {}
    with TensorMemoryTracker(trainer.resident_tensors()) as tracker:

        def noted_step():
            peak["forward_backward"] = tracker.peak
            optimizer_step()

        trainer.optimizer.step = noted_step
        trainer.step(*next(batches))
    return tracker.baseline, peak["forward_backward"]


@pytest.mark.parametrize(
    "mode", ["none", pytest.param("full", marks=pytest.mark.slow), pytest.param("experts", marks=pytest.mark.slow)]
)
def test_plan_meets_the_peak_of_a_real_step(mode):
    step = spec("bf16", MODES[mode])
    step["run"]["tokens_per_step"] = 4 * TOKENS
    step["parallel"]["microbatches"] = 4
    # The experts' weight gradients made whole: then they are the backward's largest transient, which
    # the plan meets; added inside their GEMM they do not exist, and the peak moves to the eager
    # RMSNorm's fp32 backward temporaries, which the plan does not count (the test after this one).
    step["parallel"]["accumulate_in_gemm"] = False
    scenario = scenario_from_dict(step)
    resident, peak = step_peak(scenario)
    _, details = plan_scenario(scenario)
    memory = details["per_rank"]["memory_bytes"]
    state = memory["params"] + memory["grads"] + memory["optimizer"]
    assert abs(resident / state - 1) < 0.01
    # The forward and backward's peak: a block's backward (the LM head's is smaller at vocabulary 128).
    transient = memory["activations"] + memory["comm_buffers"] + memory["backward_workspace"]
    assert 0 <= (peak - resident) / transient - 1 < 0.06


def test_weight_gradients_added_in_their_gemm_lower_the_peak():
    """Where the experts' weight gradients go straight into the fp32 buffer, the real step's peak is
    lower, and the plan's workspace loses at most their bytes, (E / ep) * 3 * D * F in bf16 (its
    largest candidate may become another one)."""
    peaks, workspaces = {}, {}
    for in_gemm in (False, True):
        step = spec("bf16", {})
        step["run"]["tokens_per_step"] = 4 * TOKENS
        step["parallel"]["microbatches"] = 4
        step["parallel"]["accumulate_in_gemm"] = in_gemm
        scenario = scenario_from_dict(step)
        resident, peak = step_peak(scenario)
        peaks[in_gemm] = peak - resident
        workspaces[in_gemm] = plan_scenario(scenario)[1]["per_rank"]["memory_bytes"]["backward_workspace"]
        moe = scenario.model.moe
    assert peaks[True] < peaks[False]
    weight_grads = 2 * moe.num_experts * 3 * scenario.model.d_model * moe.expert_hidden
    assert 0 < workspaces[False] - workspaces[True] <= weight_grads
