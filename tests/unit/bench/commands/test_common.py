"""bench.commands.common: exit codes, one-line errors, the results-folder check, the accept options and
reading one side of a comparison."""

from __future__ import annotations

import json
import os

import pytest
from result_docs import make_doc

from bench.commands import common
from bench.commands.common import (
    EXIT_BAD_INPUT,
    accepted_increases,
    accepted_work,
    fail,
    load_side,
    parse_accept_options,
    unwritable,
)
from bench.metrics import WORK_METRIC_NAMES, names
from bench.release import record
from bench.results import NoResultDocuments, ResultDocument, ResultFileError, metric, write_result


def test_exit_codes_are_the_documented_ones():
    assert (common.EXIT_OK, common.EXIT_FAILED, common.EXIT_BAD_INPUT) == (0, 1, 2)


def test_fail_writes_one_error_line_to_stderr_and_returns_bad_input(capsys):
    assert fail("x.yaml: no such scenario file") == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert (out, err) == ("", "moe-bench: error: x.yaml: no such scenario file\n")


def test_a_writable_folder_or_one_that_can_be_made_in_it_is_fine(tmp_path):
    assert unwritable(tmp_path) is None
    assert unwritable(tmp_path / "not" / "yet" / "made") is None


def test_a_file_in_the_way_is_named_with_its_owner(tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("")
    problem = unwritable(blocker / "results")
    assert problem is not None
    assert problem.startswith(f"{blocker / 'results'}: results folder not writable by uid {os.getuid()} ")
    assert f"({blocker} is owned by uid {blocker.stat().st_uid})" in problem
    assert "HOST_UID/HOST_GID" in problem


def test_a_folder_without_write_access_is_refused(tmp_path, monkeypatch):
    # chmod does not stop root: refuse the access check for this one folder instead.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if path == locked else real_access(path, mode))
    problem = unwritable(locked / "results")
    assert problem is not None and f"({locked} is owned by uid" in problem
    assert unwritable(tmp_path / "elsewhere") is None


def test_accepted_work():
    assert accepted_work(None) is None
    assert accepted_work("all") == frozenset(WORK_METRIC_NAMES)
    assert accepted_work(" work_aten_ops , work_host_syncs,") == {"work_aten_ops", "work_host_syncs"}
    assert accepted_work("") == frozenset()
    with pytest.raises(ValueError, match=r"^--accept-work: ") as caught:
        accepted_work("work_aten_ops,step_time_s")
    assert str(caught.value) == (
        "--accept-work: unknown work metric step_time_s (known: work_allocated_bytes, work_aten_ops, "
        "work_collective_bytes, work_collective_calls, work_host_syncs, work_matmul_flops)"
    )


def test_accepted_increases():
    acceptable = names(acceptable_increase=True)
    assert "peak_tensor_bytes" in acceptable
    assert accepted_increases(None) == frozenset()
    assert accepted_increases("peak_tensor_bytes, ") == {"peak_tensor_bytes"}
    with pytest.raises(ValueError, match=r"^--accept-increase: ") as caught:
        accepted_increases("peak_tensor_bytes,work_aten_ops")
    assert str(caught.value).startswith("--accept-increase: work_aten_ops is not an exact metric the gate can accept")
    assert str(caught.value).endswith("; work counters: --accept-work)")


def releases_file(tmp_path, *accepted: str):
    path = tmp_path / "releases.json"
    entry = {"version": "0.2.0", "commit": "0" * 40, "date": "2026-12-01", "accepted": list(accepted)}
    path.write_text(json.dumps({"releases": [entry]}))
    return path


def test_parse_accept_options_adds_the_recorded_releases_own(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "RELEASES_PATH", releases_file(tmp_path, "step_time_s@a<=3%: recorded"))
    given = "peak_tensor_bytes@e8,e64<=6%: fp32 grads"
    (mine, recorded) = parse_accept_options([given])
    assert (mine.metrics, mine.scenarios, mine.max_change, mine.reason, mine.release) == (
        ("peak_tensor_bytes",),
        ("e8", "e64"),
        0.06,
        "fp32 grads",
        None,
    )
    assert (recorded.metrics, recorded.release, recorded.max_change) == (("step_time_s",), "0.2.0", 0.03)
    assert parse_accept_options([given], with_releases=False) == [mine]
    assert parse_accept_options([], with_releases=False) == []


def test_parse_accept_options_names_the_option_in_its_errors():
    with pytest.raises(ValueError, match=r"^--accept 'peak_tensor_bytes<=6%: x': no '@'"):
        parse_accept_options(["peak_tensor_bytes<=6%: x"], with_releases=False)
    with pytest.raises(
        ValueError, match=r"^--accept .*unknown metric peak_tensr_bytes \(did you mean peak_tensor_bytes\?\)"
    ):
        parse_accept_options(["peak_tensr_bytes@e8<=6%: typo"], with_releases=False)


def test_a_metric_of_the_documents_may_be_accepted_though_not_gated():
    doc = ResultDocument(make_doc(metrics={"my_latency_s": metric([1.0], "s", "lower")}))
    (acceptance,) = parse_accept_options(["my_latency_s@smoke-e8<=10%: new"], [doc], with_releases=False)
    assert acceptance.metrics == ("my_latency_s",)
    with pytest.raises(ValueError, match="unknown metric my_latency_s"):
        parse_accept_options(["my_latency_s@smoke-e8<=10%: new"], with_releases=False)


def write_side(folder, *docs):
    for doc in docs:
        write_result(doc, folder / doc["engine"]["version"] / doc["machine"]["name"])
    return folder


def test_load_side_reads_a_folder_or_one_file(tmp_path):
    folder = write_side(tmp_path / "side", make_doc("a"), make_doc("b"))
    assert sorted(d.name for d in load_side(str(folder))) == ["a", "b"]
    one = folder / "0.1.0" / "1xnvidia-h200" / "a.json"
    assert [d.name for d in load_side(str(one))] == ["a"]


def test_load_side_stops_on_a_bad_file_or_skips_it_with_a_warning(tmp_path, capsys):
    folder = write_side(tmp_path / "side", make_doc("a"))
    bad = folder / "0.1.0" / "1xnvidia-h200" / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ResultFileError, match=str(bad)):
        load_side(str(folder))
    assert [d.name for d in load_side(str(folder), skip_bad=True)] == ["a"]
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"moe-bench: warning: {bad}: ") and warning.endswith("; skipped")


def test_load_side_of_nothing_readable_is_bad_input(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoResultDocuments, match=f"^{empty}: no result documents$"):
        load_side(str(empty))
    (empty / "bad.json").write_text("[]")
    with pytest.raises(NoResultDocuments, match=r"no result documents \(1 unreadable file skipped\)"):
        load_side(str(empty), skip_bad=True)
    with pytest.raises(FileNotFoundError):
        load_side(str(tmp_path / "missing"))
