"""The reference release's comparisons: the pairs in scenarios/suites.yaml, their ratios, and where
they are shown (the summary of moe-bench run, the report's index)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from result_docs import make_doc

from bench.cli import main
from bench.predict.plan import plan_scenario
from bench.report.comparisons import PairComparison, PairComparisonError, load_comparisons, pair_ratios
from bench.report.plot import plot_results
from bench.results import metric, result_dir, write_result
from bench.scenario import SCENARIOS_DIR, load_scenario

COMPARISONS = load_comparisons()
SHIPPED = {p.stem: p for p in SCENARIOS_DIR.rglob("*.yaml") if p.name != "suites.yaml"}
PAIRS = [(c.name, a, b) for c in COMPARISONS for a, b in c.pairs]
TINY = {
    "schema_version": 1,
    "mode": "execute",
    "precision": "fp32",
    "model": {
        "vocab_size": 128,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "seq_len": 32,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32},
    },
    "run": {"warmup_steps": 1, "steps": 3, "tokens_per_step": 128, "timeout_s": 120},
}


def write_scenario(folder: Path, name: str, data: dict) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


def test_the_published_comparisons_are_defined():
    assert {c.name for c in COMPARISONS} >= {
        "ddp-ep-over-fsdp",
        "sync-over-no-sync",
        "mxfp8-over-bf16",
        "experts-128-over-8",
        "zero1-over-none",
        "pp-over-ep",
    }


@pytest.mark.parametrize("comparison, numerator, denominator", PAIRS, ids=lambda v: v)
def test_a_pair_names_shipped_scenarios_of_one_size(comparison, numerator, denominator):
    """Both sides exist, on the same kind of host (both CPU twins or both GPU), with the same world size,
    tokens per step and active parameters: the pair differs in what it compares, not in size."""
    assert numerator in SHIPPED and denominator in SHIPPED
    a, b = load_scenario(SHIPPED[numerator]), load_scenario(SHIPPED[denominator])
    assert SHIPPED[numerator].parent.name.startswith("smoke") == SHIPPED[denominator].parent.name.startswith("smoke")
    assert a.world_size == b.world_size
    assert a.run.tokens_per_step == b.run.tokens_per_step
    active_a, active_b = (plan_scenario(s)[0]["active_params"]["median"] for s in (a, b))
    # Top-k alike, more experts add active parameters through the router's rows alone (E x d_model a layer).
    assert a.model.moe.top_k == b.model.moe.top_k
    router_rows = (
        (a.model.moe.num_experts - b.model.moe.num_experts)
        * a.model.d_model
        * (a.model.n_layers - a.model.n_dense_layers)
    )
    assert active_a - active_b == router_rows


def side(status: str = "ok", **medians: float):
    return status, {name: metric([value * 0.99, value, value * 1.01], "x", "higher") for name, value in medians.items()}


def test_ratios_are_the_medians_divided():
    fsdp = PairComparison("a", "A / B", ("tokens_per_s_per_gpu",), "m", "2.68", (("ddp", "fsdp"), ("ddp2", "fsdp2")))
    memory = PairComparison(
        "m",
        "M",
        ("cuda_peak_active_bytes", "peak_tensor_bytes"),
        "m",
        "0.92",
        (("mx", "bf"), ("mx-failed", "bf"), ("gone", "bf"), ("skip-a", "skip-b")),
    )
    results = {
        "ddp": side(tokens_per_s_per_gpu=52000.0),
        "fsdp": side(tokens_per_s_per_gpu=19400.0),
        # the numerator has both memory metrics, the denominator only the CPU one: the CPU one is compared
        "mx": side(cuda_peak_active_bytes=7.0, peak_tensor_bytes=95.0),
        "bf": side(peak_tensor_bytes=103.0),
        "mx-failed": side("failed"),
        "skip-a": side("skipped"),
        "skip-b": side("skipped"),
    }
    rows = pair_ratios([fsdp, memory], results)
    got = [(r.comparison.name, r.numerator, r.denominator, r.metric, r.ratio, r.note) for r in rows]
    assert got == [
        ("a", "ddp", "fsdp", "tokens_per_s_per_gpu", pytest.approx(52000 / 19400), None),
        ("m", "mx", "bf", "peak_tensor_bytes", pytest.approx(95 / 103), None),
        ("m", "mx-failed", "bf", None, None, "mx-failed failed"),
    ]  # ddp2/fsdp2 and gone/bf have a side missing, skip-a/skip-b no side that ran: left out


def test_a_side_without_the_metric_has_no_ratio():
    c = PairComparison("a", "A", ("tokens_per_s_per_gpu",), "m", "r", (("x", "y"),))
    (row,) = pair_ratios([c], {"x": side(tokens_per_s_per_gpu=1.0), "y": side(step_time_s=2.0)})
    assert row.ratio is None and row.note == "no tokens_per_s_per_gpu on both sides"


BAD_SECTIONS = [
    ("comparisons: {a: 1}", "comparisons: must be a list"),
    ("comparisons: [{name: a, label: A, metric: m, mirrors: x, reference: y}]", "comparisons.0.pairs: missing"),
    (
        "comparisons: [{name: a, label: A, metric: [], mirrors: x, reference: y, pairs: [[p, q]]}]",
        "comparisons.0.metric: a metric name or a list of them",
    ),
    (
        "comparisons: [{name: a, label: A, metric: m, mirrors: x, reference: y, pairs: [[p]]}]",
        "comparisons.0.pairs.0: must be [numerator, denominator] scenario names",
    ),
    (
        "comparisons: [{name: a, label: A, metric: m, mirrors: x, reference: y, pairs: [[p, p]]}]",
        "comparisons.0.pairs.0: compares p with itself",
    ),
    (
        (
            "comparisons:\n- {name: a, label: A, metric: m, mirrors: x, reference: y, pairs: [[p, q]]}\n"
            "- {name: a, label: B, metric: m, mirrors: x, reference: y, pairs: [[p, q]]}"
        ),
        "comparisons.1.name: duplicate",
    ),
]


@pytest.mark.parametrize("text, message", BAD_SECTIONS, ids=[m for _, m in BAD_SECTIONS])
def test_a_malformed_section_names_the_field(tmp_path, text, message):
    path = tmp_path / "suites.yaml"
    path.write_text(text)
    with pytest.raises(PairComparisonError, match=re.escape(f"{path}: {message}")):
        load_comparisons(path)


def test_the_run_summary_prints_each_pair_that_ran(tmp_path, monkeypatch, capsys):
    """Two CPU twins under their shipped names, run through moe-bench run with a worker that reports
    chosen throughputs: the summary shows the hand-computed ratio, and a lone scenario no pair."""
    from bench.run import execute, runner

    monkeypatch.setattr(runner, "available_memory_bytes", lambda device: (20 * 2**30, "MemAvailable"))
    monkeypatch.setattr(execute, "measure_peak_tflops", lambda device, dtype, seconds=1.0: 1.0)
    throughput = {
        "e8-ep2-sync-bf16": [300.0, 310.0, 290.0, 305.0, 295.0],
        "e8-ep2-nosync-bf16": [400.0, 380.0, 420.0, 390.0, 410.0],
        "e8-dp2-fsdp-bf16": [100.0] * 5,
        "lonely": [7.0],
    }

    def fake_worker(command, timeout, env=None):
        spec = json.loads(Path(command[-2]).read_text())["spec"]
        metrics = {"tokens_per_s_per_gpu": metric(throughput[spec["name"]], "tokens/s", "higher")}
        Path(command[-1]).write_text(json.dumps({"status": "ok", "error": None, "metrics": metrics, "details": {}}))
        return 0, []

    monkeypatch.setattr(runner, "run_with_timeout", fake_worker)
    files = [
        str(write_scenario(tmp_path, name, {**TINY, "parallel": {"dp": 2}})) for name in throughput if name != "lonely"
    ]
    files.append(str(write_scenario(tmp_path, "lonely", TINY)))
    assert main(["run", *files, "--out", str(tmp_path / "r"), "--device", "cpu", "--no-plots"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("comparisons ("))
    lines = out[start : start + 8]
    # The 95% interval of five samples a side steps over the 2 smallest and 2 largest of the 25 ratios
    # (Mann-Whitney's critical U for 5 and 5 is 2): sync / no-sync's third smallest is 290 / 410, its
    # third largest 310 / 390; no-sync / FSDP's are 380 / 100 and 420 / 100.
    assert lines == [
        "comparisons (numerator / denominator: ratio of the medians [95% interval from the two runs' steps]):",
        "  measured on a CPU: the published figures are GPU figures, which a CPU is not expected to match (compare the "
        "ratios'",
        "  direction, not their size)",
        "  DDP+EP / FSDP tokens/s: published GPU figure 2.68 (52,000 / 19,400 tokens/s per GPU) (OLMo-core 3: 47B MoE on "
        "8 B300,",
        "      DDP with resident experts and EP against FSDP)",
        "    e8-ep2-nosync-bf16 / e8-dp2-fsdp-bf16 = 4.000 [3.800, 4.200]",
        "  sync / no-sync dispatch tokens/s: none published",
        "    e8-ep2-sync-bf16 / e8-ep2-nosync-bf16 = 0.750 [0.707, 0.795]",
    ]
    assert out[start + 8].startswith(f"{len(throughput)} scenarios, 0 not ok")
    assert max(len(line) for line in lines) <= 120


def test_a_bad_comparisons_section_is_bad_input(tmp_path, monkeypatch, capsys):
    from bench.report import comparisons

    bad = tmp_path / "suites.yaml"
    bad.write_text("comparisons: [{name: a}]")
    monkeypatch.setattr(comparisons, "COMPARISONS_PATH", bad)
    out = tmp_path / "r"
    assert main(["run", str(write_scenario(tmp_path, "t", TINY)), "--out", str(out), "--device", "cpu"]) == 2
    assert f"{bad}: comparisons.0.label: missing" in capsys.readouterr().err
    assert not out.exists()


def test_the_report_index_shows_each_pair_per_version_and_machine(tmp_path):
    results = tmp_path / "results"

    def put(version, machine, name, tokens, status="ok"):
        metrics = {"tokens_per_s_per_gpu": metric([tokens, tokens], "tokens/s", "higher")} if status == "ok" else {}
        write_result(
            make_doc(name, metrics, status=status, version=version, machine=machine),
            result_dir(results, version, machine),
        )

    put("0.1.0", "gpu-box", "node8-e128-ddp-ep8-nosync-bf16", 52000.0)
    put("0.1.0", "gpu-box", "node8-e128-fsdp-bf16", 20000.0)
    put("0.2.0", "gpu-box", "node8-e128-ddp-ep8-nosync-bf16", 48000.0)
    put("0.2.0", "gpu-box", "node8-e128-fsdp-bf16", 24000.0)
    # The newest run decides, as the gate pools: a side that failed last has no ratio, so no row.
    put("0.3.0", "gpu-box", "node8-e128-ddp-ep8-nosync-bf16", 50000.0)
    put("0.3.0", "gpu-box", "node8-e128-fsdp-bf16", 22000.0)
    put("0.3.0", "gpu-box", "node8-e128-fsdp-bf16", 0.0, status="failed")
    put("0.2.0", "cpu-box", "e8-ep2-nosync-bf16", 900.0)  # its pair is missing on this machine: no row
    plot_results(results, tmp_path / "plots")
    page = (tmp_path / "plots" / "index.html").read_text()
    section = page[page.index("<h2>Comparisons</h2>") : page.index("<h2>Not ok")]
    rows = re.findall(
        r"<tr><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td><td>([^<]*)</td>"
        r"<td>([^<]*)</td><td>([^<]*)</td>",
        section,
    )
    assert rows == [
        (
            "0.1.0",
            "gpu-box",
            "DDP+EP / FSDP tokens/s",
            "node8-e128-ddp-ep8-nosync-bf16",
            "node8-e128-fsdp-bf16",
            "tokens_per_s_per_gpu",
            f"{52000 / 20000:.3f} (too few samples for an interval)",
        ),
        (
            "0.2.0",
            "gpu-box",
            "DDP+EP / FSDP tokens/s",
            "node8-e128-ddp-ep8-nosync-bf16",
            "node8-e128-fsdp-bf16",
            "tokens_per_s_per_gpu",
            f"{48000 / 24000:.3f} (too few samples for an interval)",
        ),
    ]


# --------------------------------------------------------------------------------------------
# The ratio's interval
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, m", [(1, 1), (2, 3), (4, 4), (5, 5), (3, 7)])
def test_the_null_distribution_counts_every_ordering(n, m):
    """The table behind the interval against brute force: every way to choose which n of the n + m
    ranks are the first sample's, and the U each gives (pairs with the first sample above)."""
    from itertools import combinations

    from bench.report.comparisons import _mann_whitney_counts

    counts = [0] * (n * m + 1)
    for firsts in combinations(range(n + m), n):
        seconds = [r for r in range(n + m) if r not in firsts]
        counts[sum(a > b for a in firsts for b in seconds)] += 1
    assert list(_mann_whitney_counts(n, m)) == counts


# Two-sided 5% critical values of the Mann-Whitney U from the published tables: the interval steps over
# that many of the n*m sorted ratios at each end, plus none: k = U_crit + 1.
CRITICAL_U = [
    ((4, 4), 0),
    ((5, 5), 2),
    ((6, 6), 5),
    ((7, 7), 8),
    ((8, 8), 13),
    ((10, 10), 23),
    ((5, 10), 8),
    ((20, 20), 127),
]


@pytest.mark.parametrize("sizes, critical", CRITICAL_U, ids=[f"{a}x{b}" for (a, b), _ in CRITICAL_U])
def test_the_interval_trims_the_tabled_count(sizes, critical):
    from bench.report.comparisons import trimmed_differences

    assert trimmed_differences(*sizes) == critical + 1


def test_too_few_samples_give_no_interval():
    from bench.report.comparisons import ratio_interval

    assert ratio_interval([1.0, 1.1, 1.2], [1.0, 1.1, 1.2]) is None  # the smallest p at 3 and 3 is 0.1
    assert ratio_interval([1.0, 1.1, 1.2, 1.3], [0.0, 1.0, 1.1, 1.2]) is None  # a zero has no logarithm
    assert ratio_interval([1.0, 1.1, 1.2, 1.3], [1.0, 1.1, 1.2, 1.3]) == pytest.approx((1.0 / 1.3, 1.3 / 1.0))  # k = 1


def test_the_interval_covers_a_known_ratio_as_often_as_it_says():
    """Five lognormal steps a side, a true ratio of 1.1: the interval is exact for a shift, so it holds the
    ratio in 1 - 2 * 4 / 252 = 96.8% of runs (P(U <= 2) = 4 / 252 at 5 and 5); 3,000 runs put that
    within +-3 standard errors (0.3%). Trimming one ratio fewer or more gives 98.4% or 94.4%."""
    import random

    from bench.report.comparisons import ratio_interval

    seed = 20261202
    rng = random.Random(seed)
    runs, held = 3000, 0
    for _ in range(runs):
        slow = [1.1 * rng.lognormvariate(0.0, 0.05) for _ in range(5)]
        fast = [rng.lognormvariate(0.0, 0.05) for _ in range(5)]
        low, high = ratio_interval(slow, fast)
        held += low <= 1.1 <= high
    coverage = 1 - 2 * 4 / 252
    error = (coverage * (1 - coverage) / runs) ** 0.5
    assert abs(held / runs - coverage) < 3 * error, (seed, held / runs)


def test_a_ratio_says_when_it_is_within_noise():
    c = PairComparison("a", "A", ("tokens_per_s_per_gpu", "peak_tensor_bytes"), "m", "r", (("x", "y"),))
    noisy = {
        "x": ("ok", {"tokens_per_s_per_gpu": metric([101.0, 99.0, 103.0, 98.0, 100.0], "t", "higher")}),
        "y": ("ok", {"tokens_per_s_per_gpu": metric([100.0, 102.0, 97.0, 99.0, 101.0], "t", "higher")}),
    }
    (row,) = pair_ratios([c], noisy)
    assert row.within_noise and row.describe().endswith(", within noise")
    exact = {
        "x": ("ok", {"peak_tensor_bytes": metric([150.0], "bytes", "lower")}),
        "y": ("ok", {"peak_tensor_bytes": metric([100.0], "bytes", "lower")}),
    }
    (row,) = pair_ratios([c], exact)
    assert row.exact and row.interval is None and row.describe() == "1.500 (exact values)"
