"""bench.report.plot: the report's charts as PNG files, the index page, semantic version order and the
expert-count sweep."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from bench.report import ordering
from bench.report.collect import load_result_set
from bench.report.ordering import sort_versions, version_sort_key
from bench.report.plot import all_charts, plot_results
from bench.report.trends import headline_metrics
from bench.results import SCHEMA_VERSION, load_results, metric, result_dir, scenario_hash, write_result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

MACHINES = {
    "gpu-box": {
        "name": "gpu-box",
        "cpu_model": "Test CPU",
        "cpu_cores": 16,
        "gpu_name": "Test GPU",
        "gpu_count": 8,
        "torch": "2.8.0",
        "triton": "3.4.0",
        "python": "3.12.0",
        "platform": "Linux",
    },
    "cpu-box": {
        "name": "cpu-box",
        "cpu_model": "Test CPU",
        "cpu_cores": 2,
        "gpu_name": None,
        "gpu_count": 0,
        "torch": "2.8.0",
        "triton": None,
        "python": "3.12.0",
    },
}

BASE_SPEC = {
    "schema_version": 1,
    "name": "smoke",
    "mode": "execute",
    "model": {
        "vocab_size": 1024,
        "d_model": 256,
        "n_layers": 2,
        "n_heads": 4,
        "seq_len": 256,
        "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 256},
    },
    "routing": {"mode": "random", "seed": 0, "zipf_exponent": 1.0},
    "precision": "bf16",
    "parallel": {"dp": 1, "ep": 1, "pp": 1},
    "run": {"warmup_steps": 2, "steps": 5, "tokens_per_step": 2048},
}

VERSIONS = ["0.1.0", "0.2.0", "0.10.0"]  # lexicographic order would put 0.10.0 before 0.2.0


def spec_for(name: str, num_experts: int = 8, top_k: int = 2, d_model: int = 256) -> dict:
    spec = copy.deepcopy(BASE_SPEC)
    spec["name"] = name
    spec["description"] = f"{name} scenario"
    spec["model"]["d_model"] = d_model
    spec["model"]["moe"].update(num_experts=num_experts, top_k=top_k)
    return spec


def make_doc(
    version: str,
    machine: str,
    spec: dict,
    *,
    status: str = "ok",
    error: str | None = None,
    metrics: dict | None = None,
    mode: str = "execute",
) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "engine": {"version": version, "git_commit": None, "git_dirty": None},
        "timestamp": "2025-01-01T00:00:00Z",
        "machine": MACHINES[machine],
        "scenario": {"name": spec["name"], "file": None, "hash": scenario_hash(spec), "spec": spec},
        "mode": mode,
        "status": status,
        "error": error,
        "metrics": {} if metrics is None else metrics,
    }


def execute_metrics(scale: float, active: float | None = None) -> dict:
    out = {
        "tokens_per_s_per_gpu": metric([1000 * scale, 1040 * scale, 980 * scale, 1010 * scale], "tokens/s", "higher"),
        "tflops_per_gpu": metric([10 * scale, 10.5 * scale, 9.8 * scale], "TFLOP/s", "higher"),
        "step_time_s": metric([0.5 / scale, 0.52 / scale, 0.49 / scale], "s", "lower"),
        "peak_memory_gib": metric([3.2], "GiB", "lower"),  # one sample
    }
    if active is not None:
        out["active_params"] = metric([active], "params", None)
    return out


def write(root: Path, doc: dict) -> Path:
    return write_result(doc, result_dir(root, doc["engine"]["version"], doc["machine"]["name"]))


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """Three versions, two machines, an expert sweep (8/32/128) in the newest version, one failed doc."""
    root = tmp_path / "results"
    for i, version in enumerate(VERSIONS):
        scale = 1.0 + 0.1 * i
        for machine in MACHINES:
            write(root, make_doc(version, machine, spec_for("smoke"), metrics=execute_metrics(scale)))
        plan = spec_for("plan-big", d_model=1024)
        plan["mode"] = "plan"
        write(
            root,
            make_doc(
                version,
                "gpu-box",
                plan,
                mode="plan",
                metrics={
                    "est_step_time_s": metric([1.5 / scale], "s", "lower"),
                    "est_memory_gib": metric([60.0], "GiB", None),
                },
            ),
        )
    # An expert-count sweep on gpu-box: identical specs but num_experts (and the name labels).
    for n in (8, 32, 128):
        doc = make_doc(
            "0.10.0",
            "gpu-box",
            spec_for(f"sweep-e{n}", num_experts=n, top_k=4),
            metrics=execute_metrics(8 / n, active=1e6 * (1 + n / 64)),
        )
        write(root, doc)
    # A failed doc (no metrics) and a second run of smoke that failed: figures use the ok run.
    write(
        root,
        make_doc(
            "0.2.0", "cpu-box", spec_for("broken-scenario"), status="failed", error="RuntimeError: <boom> & friends"
        ),
    )
    write(root, make_doc("0.10.0", "cpu-box", spec_for("smoke"), status="oom", error="CUDA out of memory"))
    # A skipped doc.
    write(root, make_doc("0.1.0", "gpu-box", spec_for("skipped-one"), status="skipped", error="needs 8 GPUs"))
    return root


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 2000, (path, len(data))


def test_version_ordering_is_semantic():
    assert sort_versions(["0.10.0", "0.2.0", "0.1.0"]) == ["0.1.0", "0.2.0", "0.10.0"]
    assert sort_versions(["0.1.0", "0.1.0+g1234.dirty", "0.1.0.dev3", "0.1.1", "0.1.0rc1"]) == [
        "0.1.0.dev3",
        "0.1.0rc1",
        "0.1.0",
        "0.1.0+g1234.dirty",
        "0.1.1",
    ]
    assert sort_versions(["zzz", "1.0.0", "not-a-version", "0.9"]) == ["0.9", "1.0.0", "not-a-version", "zzz"]
    assert sort_versions(["0.2.0", "0.2.0"]) == ["0.2.0"]
    assert version_sort_key("1.2.3") < version_sort_key("1.10.0") < version_sort_key("unknown")


def test_fallback_version_parser_orders_like_packaging(monkeypatch):
    monkeypatch.setattr(ordering, "_Version", None)
    assert sort_versions(["0.10.0", "0.2.0", "0.1.0", "garbage"]) == ["0.1.0", "0.2.0", "0.10.0", "garbage"]
    assert sort_versions(["0.1.0", "0.1.0+g1234.dirty", "0.1.0.dev3", "0.1.1", "0.1.0rc1", "0.1.0.post1"]) == [
        "0.1.0.dev3",
        "0.1.0rc1",
        "0.1.0",
        "0.1.0+g1234.dirty",
        "0.1.0.post1",
        "0.1.1",
    ]


def test_plot_results_writes_figures_and_index(results: Path, tmp_path: Path):
    out = tmp_path / "plots"
    written = plot_results(results, out)

    assert written[-1] == out / "index.html"
    assert all(p.parent == out and p.exists() for p in written)
    pngs = [p for p in written if p.suffix == ".png"]
    names = {p.name for p in pngs}
    assert {
        "summary.png",
        "expert_sweep--gpu-box--execute.png",
        "gpu-box--smoke.png",
        "cpu-box--smoke.png",
        "gpu-box--plan-big.png",
        "gpu-box--sweep-e8.png",
    } <= names
    # No figure for scenarios that never produced an ok result.
    assert not any("broken-scenario" in n or "skipped-one" in n for n in names)
    for p in pngs:
        assert_png(p)

    index = (out / "index.html").read_text()
    for p in pngs:
        assert f'src="{p.name}"' in index
    assert "broken-scenario" in index and "failed" in index
    assert "RuntimeError: &lt;boom&gt; &amp; friends" in index  # escaped
    assert "<boom>" not in index
    assert "oom" in index and "skipped-one" in index
    assert not re.search(r"(src|href)=\"https?://", index)  # self-contained
    # The table lists versions in semantic order.
    rows = re.findall(r"<tr class=\"[a-z]+\"><td>([^<]+)</td>", index)
    assert len(rows) == len(load_results(results))
    assert rows == sorted(rows, key=version_sort_key)
    assert rows.index("0.10.0") > rows.index("0.2.0")


def _sweeps(root: Path) -> list:
    return [c for c in all_charts(load_result_set(root), comparisons=[]) if c.kind == "sweep"]


def test_the_expert_sweep_draws_each_scenarios_median(results: Path):
    (sweep,) = _sweeps(results)
    assert "gpu-box, version 0.10.0" in sweep.title
    name = "sweep-e8 / sweep-e32 / sweep-e128"
    assert sweep.series == [f"{name}: throughput"]
    (line,) = [ln for ln in sweep.figure.axes[0].lines if ln.get_gid() == "series-0"]
    # The medians of execute_metrics(8 / n): 1005 tokens/s (the median of its four samples) scaled.
    assert line.get_xdata().tolist() == [8, 32, 128]
    assert line.get_ydata().tolist() == pytest.approx([1005 * 8 / n for n in (8, 32, 128)])


def test_sweep_skipped_without_group(tmp_path: Path):
    root = tmp_path / "results"
    # Different num_experts but also a different d_model: not a sweep. Only one version here.
    write(root, make_doc("0.3.0", "gpu-box", spec_for("a", num_experts=8), metrics=execute_metrics(1.0)))
    write(root, make_doc("0.3.0", "gpu-box", spec_for("b", num_experts=32, d_model=512), metrics=execute_metrics(0.5)))
    # The same pair split over two machines is not a sweep either.
    write(root, make_doc("0.3.0", "cpu-box", spec_for("c", num_experts=64), metrics=execute_metrics(0.4)))
    assert _sweeps(root) == []
    out = tmp_path / "plots"
    written = plot_results(root, out)
    assert "expert_sweep" not in (out / "index.html").read_text()
    assert {p.name for p in written} == {
        "summary.png",
        "gpu-box--a.png",
        "gpu-box--b.png",
        "cpu-box--c.png",
        "index.html",
    }
    for p in written[:-1]:
        assert_png(p)


def test_the_sweep_is_drawn_at_the_newest_version_that_has_it(tmp_path: Path):
    root = tmp_path / "results"
    for n in (8, 16):
        write(root, make_doc("0.1.0", "gpu-box", spec_for(f"e{n}", num_experts=n), metrics=execute_metrics(8 / n)))
    write(root, make_doc("0.2.0", "gpu-box", spec_for("e8", num_experts=8), metrics=execute_metrics(1.0)))
    (sweep,) = _sweeps(root)
    assert "version 0.1.0" in sweep.title
    for n in (8, 32):
        write(root, make_doc("0.2.0", "gpu-box", spec_for(f"e{n}", num_experts=n), metrics=execute_metrics(8 / n)))
    titles = [s.title for s in _sweeps(root)]
    assert len(titles) == 1 and "version 0.2.0" in titles[0]


def test_edge_cases_do_not_crash(tmp_path: Path):
    root = tmp_path / "results"
    # Only failed/skipped docs with empty metrics: no per-scenario figures, still a summary and index.
    write(root, make_doc("0.1.0", "cpu-box", spec_for("f"), status="failed", error="boom"))
    write(root, make_doc("0.1.0", "cpu-box", spec_for("s"), status="skipped", error=None))
    out = tmp_path / "plots"
    written = plot_results(root, out)
    assert [p.name for p in written] == ["summary.png", "index.html"]
    assert_png(out / "summary.png")
    index = (out / "index.html").read_text()
    assert "failed" in index and "skipped" in index

    # Add a single ok doc with single-sample metrics and no better-direction headline.
    write(
        root,
        make_doc(
            "0.1.0",
            "cpu-box",
            spec_for("one"),
            metrics={"x": metric([1.0], "u", None), "y": metric([2.0], "v", "lower")},
        ),
    )
    written = plot_results(root, tmp_path / "plots2")
    assert {p.name for p in written} == {"summary.png", "cpu-box--one.png", "index.html"}
    assert_png(tmp_path / "plots2" / "cpu-box--one.png")

    # An empty results folder.
    (tmp_path / "empty").mkdir()
    written = plot_results(tmp_path / "empty", tmp_path / "plots3")
    assert [p.name for p in written] == ["summary.png", "index.html"]


def test_the_summary_draws_each_scenarios_first_headline_metric():
    tps = metric([1.0], "tokens/s", "higher")
    tfl = metric([1.0], "TFLOP/s", "higher")
    lat = metric([1.0], "s", "lower")
    info = metric([1.0], "GiB", None)
    assert headline_metrics([{"tflops_per_gpu": tfl}, {"tokens_per_s_per_gpu": tps}]) == ["tokens_per_s_per_gpu"]
    assert headline_metrics([{"step_time_s": lat, "tflops_per_gpu": tfl}]) == ["step_time_s"]
    assert headline_metrics([{"mem": info, "tflops_per_gpu": tfl, "step_time_s": lat}]) == ["step_time_s"]
    assert headline_metrics([{"mem": info}]) == []
    assert headline_metrics([]) == []


def test_single_sample_metrics_are_drawn_without_a_spread(tmp_path: Path):
    """A one-sample metric (spread null) gets plain points: no min..max bars and no IQR band."""
    from matplotlib.collections import PolyCollection
    from matplotlib.container import ErrorbarContainer

    root = tmp_path / "results"
    for i, version in enumerate(["0.1.0", "0.2.0"]):
        write(
            root,
            make_doc(
                version,
                "cpu-box",
                spec_for("smoke"),
                metrics={
                    "step_time_s": metric([0.5, 0.52, 0.49], "s", "lower"),
                    "peak_memory_gib": metric([3.2 + i], "GiB", "lower"),
                },
            ),
        )
    (trend,) = [c for c in all_charts(load_result_set(root), comparisons=[]) if c.name == "cpu-box--smoke"]
    drawn = {
        name: (
            any(isinstance(c, ErrorbarContainer) for c in ax.containers),
            any(isinstance(c, PolyCollection) for c in ax.collections),
        )
        for name, ax in zip(trend.series, trend.figure.axes)
    }
    assert drawn == {"step_time_s": (True, True), "peak_memory_gib": (False, False)}  # bars and band, or neither


def test_unreadable_result_files_are_skipped_and_listed(tmp_path: Path):
    root = tmp_path / "results"
    write(root, make_doc("0.1.0", "cpu-box", spec_for("smoke"), metrics=execute_metrics(1.0)))
    bad = root / "0.1.0" / "cpu-box" / "old.json"
    bad.write_text('{"timestamp": ')
    skipped = []
    written = plot_results(root, tmp_path / "plots", on_bad_file=skipped.append)
    assert [str(e) for e in skipped] == [f"{bad}: not valid JSON: Expecting value: line 1 column 15 (char 14)"]
    assert {p.name for p in written} == {"summary.png", "cpu-box--smoke.png", "index.html"}
    index = (tmp_path / "plots" / "index.html").read_text()
    assert "Skipped files (1)" in index and str(bad) in index and "Expecting value" in index
