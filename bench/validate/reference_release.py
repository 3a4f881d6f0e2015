"""The reference release's published figures next to this engine's op-level projections on B300.
More: docs/validation-tools.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from bench.logs import console_logging
from bench.predict.device import load_profile
from bench.run.project import DoesNotFit, memory_fit, project_on_device
from bench.scenario import Scenario, load_scenario
from bench.validate.variants import patched

logger = logging.getLogger(__name__)

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
DEFAULT_OUT = Path("docs/measurements/reference-release-b300.json")
REFERENCE = {
    "model": {"fused_kernels": False},
    "parallel": {"dispatch_rows": "per-expert", "overlap": "none", "a2a_chunks": 1},
}
"""The reference path's patch of every scenario: what the tests compare the fast path against."""
QWEN_ON_H100 = {
    "parallel": {
        "dp": 16,
        "ep": 16,
        "pp": 1,
        "microbatches": 64,
        "dp_mode": "ddp",
        "optimizer_sharding": "zero1",
        "dispatch": "sync",
    },
    "run": {"tokens_per_step": 1024 * 4096},
    "cluster": {"name": "h100-2node", "gpus": 16, "device": "h100-sxm"},
}
"""Megatron-Bridge's measured Qwen3-30B-A3B layout on 16 H100 (docs/validation-tools.md)."""
MEGATRON_BRIDGE_TOKENS_PER_S = 13_000


def reference_path(scenario: Scenario) -> Scenario:
    """``scenario`` on the engine's reference path (``REFERENCE``); a schedule whose layout needs the
    overlap across microbatches keeps its placement but runs every all-to-all exposed."""
    return patched(scenario, REFERENCE)


def _assumed(scenario) -> str:
    p, m = scenario.parallel_config, scenario.model
    sequences = scenario.run.tokens_per_step // m.seq_len
    return (
        f"seq_len {m.seq_len}, {sequences} sequences ({scenario.run.tokens_per_step:,} tokens) per step, "
        f"{p.microbatches} microbatches, {scenario.precision}, recompute {scenario.recompute.mode.value}, "
        f"dp {p.dp} ep {p.ep} pp {p.pp} {p.dp_mode.value}"
        + (f" + {p.optimizer_sharding.value}" if p.optimizer_sharding.value != "none" else "")
    )


ENGINES = ("reference", "shipped")
"""The two projections of each row: the reference path, and as shipped."""
NOT_RUN = "not run"


def _error(published: Any, projected: Any, metric: str) -> float | str | None:
    if projected == NOT_RUN:
        return None
    if isinstance(published, (int, float)) and isinstance(projected, (int, float)):
        return projected / published - 1
    if metric == "throughput loss" and isinstance(projected, float):
        return "within the bound" if projected < 0.05 else "outside the bound"
    if metric == "GiB per GPU" and published.startswith("fits "):
        return "fits" if float(projected) <= float(published.split()[1]) else "does not fit"
    return None


def reference_report(device: str = "b300", engines: tuple[str, ...] = ENGINES) -> dict[str, Any]:
    """The report; ``engines``: which of ``ENGINES`` to project (the others' cells say "not run"). Each
    projection is logged as it starts."""
    profile = load_profile(device)
    docs: dict[str, dict[str, Any]] = {}

    def project(name: str, engine: str, base: Scenario | None = None, on=profile) -> dict[str, Any]:
        key = f"{name} ({engine})"
        if engine not in engines:
            return {}
        if key not in docs:
            scenario = base or load_scenario(SCENARIOS / "olmo-core3" / f"{name}.yaml")
            scenario = reference_path(scenario) if engine == "reference" else scenario
            logger.info(f"projecting {key} on {on.name}")
            try:
                docs[key] = project_on_device(scenario, on) | {"assumed": _assumed(scenario)}
            except DoesNotFit as err:
                docs[key] = {"does_not_fit": str(err), "assumed": _assumed(scenario)}
        return docs[key]

    def figures(name: str, field: str) -> tuple[Any, Any]:
        reference, shipped = (project(name, e).get(field, NOT_RUN) for e in ENGINES)
        return reference, shipped

    def ratio(num: str, den: str, field: str = "tokens_per_s_per_gpu") -> tuple[Any, Any]:
        reference, shipped = (
            n / d if isinstance(n, float) and isinstance(d, float) else NOT_RUN
            for n, d in zip(figures(num, field), figures(den, field))
        )
        return reference, shipped

    gib = 2**30

    def memory(name: str, engine: str) -> str:
        doc = project(name, engine)
        return f"{doc['memory']['memory_need_bytes'] / gib:.1f}" if doc else NOT_RUN

    rows: list[dict[str, Any]] = [
        {
            "comparison": "47B MoE on 8 GPUs, DDP + EP 8",
            "metric": "tokens/s/GPU",
            "published": 52_000,
            "projected": figures("moe-128e-47b", "tokens_per_s_per_gpu"),
            "scenarios": ["moe-128e-47b"],
        },
        {
            "comparison": "the same model under FSDP",
            "metric": "tokens/s/GPU",
            "published": 19_400,
            "projected": figures("moe-128e-47b-fsdp", "tokens_per_s_per_gpu"),
            "scenarios": ["moe-128e-47b-fsdp"],
        },
        {
            "comparison": "DDP + EP over FSDP",
            "metric": "ratio",
            "published": 52_000 / 19_400,
            "projected": ratio("moe-128e-47b", "moe-128e-47b-fsdp"),
            "scenarios": ["moe-128e-47b", "moe-128e-47b-fsdp"],
        },
        {
            "comparison": "8 -> 128 experts (top-4, EP 8)",
            "metric": "throughput loss",
            "published": "< 5%",
            "projected": tuple(1 - r if isinstance(r, float) else r for r in ratio("moe-128e-47b", "moe-8e-4.6b")),
            "scenarios": ["moe-8e-4.6b", "moe-128e-47b"],
        },
        {
            "comparison": "1.2T on 512 GPUs (PP 8 x DP 64, EP 64, ZeRO-1)",
            "metric": "TFLOP/s/GPU",
            "published": 858,
            "projected": figures("moe-1.2t-512gpu", "tflops_per_gpu"),
            "scenarios": ["moe-1.2t-512gpu"],
        },
        {
            "comparison": "MXFP8 over BF16 on 4 GPUs",
            "metric": "throughput ratio",
            "published": 1.21,
            "projected": ratio("moe-mxfp8-4gpu", "moe-bf16-4gpu"),
            "scenarios": ["moe-bf16-4gpu", "moe-mxfp8-4gpu"],
        },
        {
            "comparison": "peak memory, BF16 -> MXFP8 (4 GPUs)",
            "metric": "GiB per GPU",
            "published": "103 -> 95",
            "projected": tuple(
                f"{memory('moe-bf16-4gpu', e)} -> {memory('moe-mxfp8-4gpu', e)}" if e in engines else NOT_RUN
                for e in ENGINES
            ),
            "scenarios": ["moe-bf16-4gpu", "moe-mxfp8-4gpu"],
        },
    ]
    qwen = patched(load_scenario(SCENARIOS / "models" / "qwen3-30b-a3b.yaml"), QWEN_ON_H100)
    h100 = load_profile("h100-sxm")
    qwen_docs = [project("qwen3-30b-a3b-h100x16", e, qwen, h100) for e in ENGINES]
    # The same layout with the experts' forward and input-gradient GEMMs in rowwise FP8 (Hopper's FP8 path).
    qwen_fp8_docs = [
        project("qwen3-30b-a3b-h100x16-fp8", e, patched(qwen, {"precision": "fp8"}), h100) for e in ENGINES
    ]
    rows += [
        {
            "comparison": "Qwen3-30B-A3B on 16 H100, EP 16, microbatch 1, no recompute: memory per rank "
            "(Megatron-Bridge trains it on 80 GB)",
            "metric": "GiB per GPU",
            "published": "fits 74.5",
            "projected": tuple(
                f"{memory_fit(s, h100)['memory_need_bytes'] / gib:.1f}" for s in (reference_path(qwen), qwen)
            ),
            "scenarios": ["qwen3-30b-a3b-h100x16"],
        },
        {
            "comparison": "Qwen3-30B-A3B on 16 H100 (Megatron-Bridge, measured, all-to-all overlap)",
            "metric": "tokens/s/GPU",
            "published": MEGATRON_BRIDGE_TOKENS_PER_S,
            "projected": tuple(d.get("tokens_per_s_per_gpu", "does not fit") if d else NOT_RUN for d in qwen_docs),
            "scenarios": ["qwen3-30b-a3b-h100x16"],
        },
        {
            "comparison": "FP8 (rowwise) over BF16, Qwen3-30B-A3B on 16 H100 (the layout above)",
            "metric": "throughput ratio",
            "published": "none found",
            "projected": tuple(
                f["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
                if "tokens_per_s_per_gpu" in f and "tokens_per_s_per_gpu" in b
                else NOT_RUN
                for f, b in zip(qwen_fp8_docs, qwen_docs)
            ),
            "scenarios": ["qwen3-30b-a3b-h100x16", "qwen3-30b-a3b-h100x16-fp8"],
        },
    ]
    for row in rows:
        row["projected_reference"], row["projected_shipped"] = row.pop("projected")
        row["error"] = {e: _error(row["published"], row[f"projected_{e}"], row["metric"]) for e in ENGINES}
        row["assumed"] = [docs[f"{name} ({engines[-1]})"]["assumed"] for name in row["scenarios"]]
    return {
        "command": f"python -m bench.validate.reference_release --device {device}"
        + ("" if engines == ENGINES else f" --engines {' '.join(engines)}"),
        "machine": "arithmetic (fake-tensor traces priced on the profile) on a 2-core CPU machine; no GPU ran",
        "device": profile.name,
        "device_file": profile.file,
        "device_measured": profile.measured is not None,
        "rows": rows,
        "engines": {
            "reference": f"the reference path: patched with {REFERENCE}",
            "shipped": "as shipped: the scenario files as they are, the engine's defaults",
        },
        "projections": {
            name: {
                k: doc[k]
                for k in (
                    "step_s",
                    "tokens_per_s_per_gpu",
                    "tflops_per_gpu",
                    "mfu",
                    "breakdown_s",
                    "memory",
                    "assumed",
                    "does_not_fit",
                )
                if k in doc
            }
            for name, doc in docs.items()
        },
        "unknown_in_the_release": [
            "sequence length, global batch, microbatch size, activation recompute, the EP and PP degrees, and the "
            "precision of the 52k / 19.4k / 858 runs are not stated in the material found; the scenario files' "
            "values are assumed (each row's 'assumed')",
            "whether 858 TFLOP/s counts BF16 or MXFP8 matmul FLOPs is not stated; this project counts model FLOPs "
            "by Megatron's convention (moe_engine.flops)",
            "the 1.2T run used random routing, as the scenario does; the published memory figures are peak active "
            "memory, the projected ones the plan's per-rank total",
        ],
    }


def table(report: dict[str, Any]) -> str:
    def fmt(value: Any, metric: str) -> str:
        if not isinstance(value, (int, float)):
            return str(value)
        if metric in ("tokens/s/GPU", "TFLOP/s/GPU"):
            return f"{value:,.0f}"
        if metric == "throughput loss":
            return f"{value:.1%}"
        return f"{value:.2f}x"

    def err(value: Any) -> str:
        return f"{value:+.0%}" if isinstance(value, float) else (value or "")

    lines = [
        "| comparison | metric | published | projected, reference path | error | projected, as shipped | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        m = row["metric"]
        lines.append(
            f"| {row['comparison']} | {m} | {fmt(row['published'], m)} | "
            f"{fmt(row['projected_reference'], m)} | {err(row['error']['reference'])} | "
            f"{fmt(row['projected_shipped'], m)} | {err(row['error']['shipped'])} |"
        )
    return "\n".join(lines)


def breakdown_table(report: dict[str, Any]) -> str:
    """Where each projection's step goes: compute, the expert all-to-alls (total, exposed), the bubble."""
    lines = [
        "| projection | step s | compute s | expert all-to-all: total s, exposed s (share) | bubble s |",
        "|---|---|---|---|---|",
    ]
    for name, doc in report["projections"].items():
        b = doc.get("breakdown_s")
        if b is None:
            lines.append(f"| {name} | does not fit | | | |")
            continue
        total, exposed = b["expert_comm_total"], b["expert_comm"]
        share = f" ({exposed / total:.0%})" if total else ""
        lines.append(
            f"| {name} | {doc['step_s']:.2f} | {b['compute']:.2f} | {total:.2f}, {exposed:.2f}{share} | "
            f"{b['bubble']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.validate.reference_release", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="b300")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="project only these (default: both)"
    )
    args = parser.parse_args(argv)
    engines = tuple(e for e in ENGINES if e in args.engines)
    report = reference_report(args.device, engines=engines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    sys.stdout.write(f"{table(report)}\n\n{breakdown_table(report)}\nwritten to {args.out}\n")
    return 0


if __name__ == "__main__":
    console_logging()
    # A projection's stage lines would bury the one line this tool logs per projection.
    for name in ("bench.run.project", "bench.run.trace"):
        logging.getLogger(name).setLevel(logging.WARNING)
    sys.exit(main())
