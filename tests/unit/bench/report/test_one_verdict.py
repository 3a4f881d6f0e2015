"""One verdict per scenario where its metrics come from the same runs: tokens/s and TFLOP/s per GPU are
the step times divided into constants, so they read as the step time reads."""

from __future__ import annotations

from result_docs import make_doc

from bench.gate.compare import compare
from bench.report.page import build_report
from bench.results import ResultDocument, metric, write_result

TOKENS, FLOPS = 2048.0, 1.0e12  # per step


def _doc(version: str, step_s: float) -> dict:
    # Five steps 1% apart around the median: rel_iqr 1% a side, so the noise (2%) stays under the 5% tolerance.
    steps = [step_s * f for f in (0.98, 0.99, 1.0, 1.01, 1.02)]
    metrics = {
        "step_time_s": metric(steps, "s", "lower"),
        "tokens_per_s_per_gpu": metric([TOKENS / s for s in steps], "tokens/s", "higher"),
        "tflops_per_gpu": metric([FLOPS / s / 1e12 for s in steps], "TFLOP/s", "higher"),
    }
    return make_doc("smoke-e8", metrics, version=version)


def test_the_same_runs_get_one_verdict(tmp_path):
    # Step time x1.052 is beyond the 5% tolerance: regressed. The same runs' tokens/s is x1/1.052 = 0.9506,
    # 4.94% down: within the tolerance when judged apart, the disagreement the report showed.
    base, cand = _doc("0.1.0", 1.0), _doc("0.2.0", 1.052)
    comparison = compare([ResultDocument(base)], [ResultDocument(cand)], tolerance=0.05)
    verdicts = {r.metric: r.verdict for r in comparison.rows}
    assert verdicts == {"step_time_s": "regressed", "tokens_per_s_per_gpu": "regressed", "tflops_per_gpu": "regressed"}
    ratios = {r.metric: r.ratio for r in comparison.rows}
    assert abs(ratios["tokens_per_s_per_gpu"] - 1 / 1.052) < 1e-12  # each row keeps its own ratio
    # At a looser tolerance all three are unchanged together.
    assert {r.verdict for r in comparison.with_tolerance(0.06).rows} == {"unchanged"}

    for data in (base, cand):
        write_result(data, tmp_path / "r" / data["engine"]["version"] / "1xnvidia-h200")
    page = build_report(tmp_path / "r", tmp_path / "page", releases=["0.1.0"]).path.read_text()
    assert page.count("class='verdict verdict-regressed'") == 3 and "class='verdict verdict-unchanged'" not in page


def test_the_expert_count_sweep_draws_one_machine_a_chart_and_one_version_a_line(tmp_path):
    """Two machines, each with the sweep in two versions: a chart per machine, each line of the newest
    version that has it, named with no machine (the chart's title has it)."""
    for machine in ("cpu-2c-amd-epyc", "cpu-2c-intel-r-xeon"):
        for version in ("0.1.0", "0.2.0"):
            for experts in (8, 64):
                spec = {"mode": "execute", "model": {"moe": {"num_experts": experts}}}
                tokens = metric([1000.0, 1010.0, 990.0], "tokens/s", "higher")
                data = make_doc(f"e{experts}", {"tokens_per_s_per_gpu": tokens}, spec=spec, version=version)
                data["machine"] = {**data["machine"], "name": machine, "gpu_name": None, "gpu_count": 0}
                write_result(data, tmp_path / "r" / version / machine)
    report = build_report(tmp_path / "r", tmp_path / "page", releases=[])
    sweeps = [f for kind, f in zip(report.charts, report.figures) if kind == "sweep"]
    assert len(sweeps) == 2
    for figure, machine in zip(sweeps, ("cpu-2c-amd-epyc", "cpu-2c-intel-r-xeon")):
        assert f"runs on {machine}, version 0.2.0" in figure.title
        assert figure.series == ["e8 / e64: throughput"]
