"""``moe-bench project`` while it traces: plain log lines when stderr is not a terminal (which stages
are traced, which take an identical stage's trace, ops traced so far), rich progress bars on one, and
``--every-stage`` tracing every stage."""

from __future__ import annotations

import copy
import io
import json
import logging
import re
from pathlib import Path

import pytest
import yaml
from pipeline_scenario import PIPELINE

from bench.cli import main
from bench.predict.device import load_profile
from bench.run import project
from bench.run.console import TraceBars, trace_display
from bench.run.project import sharing_text, stage_traces, traced_scenario
from bench.scenario import scenario_from_dict


def _pipeline_file(tmp_path: Path) -> Path:
    # Four stages: the two middle ones identical (one MoE block each, balanced routes).
    path = tmp_path / "pipeline-of-four.yaml"
    path.write_text(yaml.safe_dump(PIPELINE))
    return path


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("pipeline-of-four")]


@pytest.mark.slow
def test_plain_lines_name_the_shared_stages(tmp_path, capsys):
    assert main(["project", str(_pipeline_file(tmp_path)), "--device", "h100-sxm", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    # The progress is the console log's (stderr); the output (stdout) is the summary.
    assert [line for line in _lines(out) if line.startswith("pipeline-of-four:")] == []
    lines = _lines(err)
    assert lines[0] == "pipeline-of-four: 3 of 4 stages to trace; stage 2 takes stage 1's trace (identical)"
    assert (
        "pipeline-of-four: stage 1 of 4 (rank 2): tracing at full size, 2 microbatches; its trace serves stage 2"
        in lines
    )
    shared = [line for line in lines if line.startswith("pipeline-of-four: stage 2 of 4 (rank 4): ")]
    assert len(shared) == 1 and "stage 1's trace (identical stage)" in shared[0]
    for stage, rank in ((0, 0), (1, 2), (3, 6)):
        assert any(line.startswith(f"pipeline-of-four: stage {stage} of 4 (rank {rank}): traced ") for line in lines)
    assert "  stages: 3 of 4 stages traced; stage 2 took stage 1's trace (identical); the step is stage" in out
    doc = json.loads((tmp_path / "pipeline-of-four.h100-sxm.json").read_text())
    assert [s["trace_shared_with"] for s in doc["stages"]] == [None, None, 1, None]
    assert "\x1b[" not in out + err  # no terminal control codes in a log


@pytest.mark.slow
def test_every_stage_traces_every_stage_and_projects_the_same_step(tmp_path, capsys):
    path = _pipeline_file(tmp_path)
    shared, every = tmp_path / "shared", tmp_path / "every"
    assert main(["project", str(path), "--device", "h100-sxm", "--out", str(shared)]) == 0
    capsys.readouterr()
    assert main(["project", str(path), "--device", "h100-sxm", "--out", str(every), "--every-stage"]) == 0
    lines = _lines(capsys.readouterr().err)
    assert lines[0] == "pipeline-of-four: 4 of 4 stages to trace (every stage)"
    for stage in range(4):
        assert any(
            line.startswith(f"pipeline-of-four: stage {stage} of 4 ") and "tracing at full size" in line
            for line in lines
        ), stage
    assert not any("identical" in line for line in lines)
    docs = [json.loads((folder / "pipeline-of-four.h100-sxm.json").read_text()) for folder in (shared, every)]
    assert [s["trace_shared_with"] for s in docs[1]["stages"]] == [None] * 4
    assert docs[1]["step_s"] == docs[0]["step_s"]
    assert [s["ops_traced"] for s in docs[1]["stages"]] == [s["ops_traced"] for s in docs[0]["stages"]]


def test_the_trace_reports_its_ops_as_it_grows(monkeypatch, caplog):
    monkeypatch.setattr(project, "PROGRESS_EVERY_S", 0.0)
    spec = copy.deepcopy(PIPELINE)
    spec["parallel"]["pp"], spec["model"]["n_layers"], spec["cluster"]["gpus"] = 1, 2, 2
    spec["parallel"]["schedule"] = "gpipe"
    scenario = traced_scenario(scenario_from_dict(spec), 2)
    with caplog.at_level(logging.INFO, logger="bench.run"):
        [staged] = stage_traces(scenario, load_profile("h100-sxm"))
    counts = [r.getMessage() for r in caplog.records if " ops traced (" in r.getMessage()]
    assert {r.levelno for r in caplog.records} == {logging.INFO}
    # One line per 1,024 ops (the trace's report interval), each naming the phase it was in.
    assert len(counts) == len(staged.trace.ops) // 1024 >= 1
    assert counts[0].startswith("pipeline-of-four: stage 0 of 1 (rank 0): 1,024 ops traced (")


def test_sharing_in_words():
    assert sharing_text([0]) == "one stage to trace"
    assert (
        sharing_text([0, 1, 1, 1, 1, 1, 1, 7]) == "3 of 8 stages to trace; stages 2-6 take stage 1's trace (identical)"
    )
    assert sharing_text([0, 1, 1, 3], done=True) == "3 of 4 stages traced; stage 2 took stage 1's trace (identical)"
    assert sharing_text([0, 1, 0, 1]) == (
        "2 of 4 stages to trace; stage 2 takes stage 0's trace (identical); stage 3 takes stage 1's trace (identical)"
    )
    assert sharing_text([0, 1, 2]) == "3 of 3 stages to trace (every stage)"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_on_a_terminal_and_lines_elsewhere(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert not isinstance(trace_display(io.StringIO()), TraceBars)
    loggers = [logging.getLogger(name) for name in ("bench.run.project", "bench.run.trace")]
    before = [(logger.level, logger.propagate, list(logger.handlers)) for logger in loggers]
    with trace_display(_Terminal()) as live:
        assert isinstance(live, TraceBars)
        assert all(live in logger.handlers and not logger.propagate for logger in loggers)
    # Closed, the loggers are as they were: their records are plain lines again.
    assert [(logger.level, logger.propagate, list(logger.handlers)) for logger in loggers] == before
    monkeypatch.setenv("CI", "1")
    assert not isinstance(trace_display(_Terminal()), TraceBars)


@pytest.mark.slow
def test_progress_bars_name_each_stage_traced_or_shared(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    terminal = _Terminal()
    scenario = traced_scenario(scenario_from_dict(copy.deepcopy(PIPELINE)), 2)
    with trace_display(terminal):
        staged = list(stage_traces(scenario, load_profile("h100-sxm")))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue())
    assert [s.shared_with for s in staged] == [None, None, 1, None]
    assert "pipeline-of-four: 3 of 4 stages to trace; stage 2 takes stage 1's trace (identical)" in text
    assert "pipeline-of-four: stage 2 of 4 (rank 4): stage 1's trace (identical stage)" in text
    for stage, s in enumerate(staged):
        if s.shared_with is None:
            assert f"stage {stage} of 4 (rank {s.rank}): traced {len(s.trace.ops):,} ops" in text
