"""bench.commands.release: ``moe-bench release`` (list, record, accept) and ``moe-bench version``, on a
releases.json in tmp_path; cutting a release (git) and running its suite are stood in for."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import ClassVar

import pytest

import bench.commands.release as release_command
import bench.run.runner
from bench.cli import main
from bench.release import record
from bench.release.record import Release, ReleaseError
from bench.results import REPO_ROOT

ONE, TWO = "1" * 40, "2" * 40
SPEC = "peak_tensor_bytes@e8-random-bf16<=6%: fp32 gradient buffers"
ELSEWHERE = "moe-bench ab --baseline-ref v{v} (this checkout and the release, on this machine), or moe-bench versions <image of {v}> <image of the checkout>"


@pytest.fixture
def releases(tmp_path, monkeypatch):
    path = tmp_path / "releases.json"
    entries = [
        {"version": "0.2.0", "commit": TWO, "date": "2026-12-01", "accepted": [SPEC]},
        {
            "version": "0.1.0",
            "commit": ONE,
            "date": "2026-11-30",
            "baseline": {"machine": "cpu-2c", "results": "results/0.1.0/cpu-2c", "commit": "abcdef0123456789"},
        },
    ]
    path.write_text(json.dumps({"releases": entries}))
    monkeypatch.setattr(record, "RELEASES_PATH", path)
    return path


def test_listing_oldest_first_with_accepted_changes_and_where_the_results_are(releases, capsys):
    assert main(["release"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"0.1.0  {ONE}  2026-11-30",
        f"  results of cpu-2c in results/0.1.0/cpu-2c at commit abcdef012345; elsewhere: {ELSEWHERE.format(v='0.1.0')}",
        f"0.2.0  {TWO}  2026-12-01",
        f"  accepted: {SPEC}",
        f"  no stored results; compare with {ELSEWHERE.format(v='0.2.0')}",
    ]


def test_latest_prints_the_newest_version_alone(releases, capsys):
    assert main(["release", "--latest"]) == 0
    assert capsys.readouterr().out == "0.2.0\n"


def test_no_releases_recorded_lists_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(record, "RELEASES_PATH", tmp_path / "none.json")
    assert main(["release"]) == 0
    assert main(["release", "--latest"]) == 0
    assert capsys.readouterr().out == ""


def test_an_acceptance_needs_a_release_to_belong_to(releases, capsys):
    assert main(["release", "--accept", SPEC]) == 2
    assert capsys.readouterr().err == (
        "moe-bench: error: --accept: name the release that makes the change: moe-bench release VERSION --accept SPEC\n"
    )


def test_an_acceptance_is_added_to_a_recorded_release(releases, capsys):
    spec = "step_time_s@e8-skewed-fp32<=3%: slower routing on purpose"
    assert main(["release", "0.1.0", "--accept", spec]) == 0
    assert capsys.readouterr().out == f"release 0.1.0 accepts {spec}\n"
    (first,) = [r for r in json.loads(releases.read_text())["releases"] if r["version"] == "0.1.0"]
    assert first["accepted"] == [spec]


def test_a_malformed_acceptance_or_record_is_bad_input(releases, capsys):
    assert main(["release", "0.1.0", "--accept", "step_time_s@x: no size"]) == 2
    assert capsys.readouterr().err.startswith("moe-bench: error: --accept 'step_time_s@x: no size': no accepted size")
    releases.write_text("{")
    assert main(["release"]) == 2
    assert capsys.readouterr().err.startswith(f"moe-bench: error: {releases}: cannot read the release record")


@pytest.fixture
def cut(monkeypatch):
    calls = []

    def fake_cut_release(version, tag=True, accepted=()):
        calls.append((version, tag, accepted))
        return Release(version, "3" * 40, "2026-12-06", tuple(accepted))

    monkeypatch.setattr(record, "cut_release", fake_cut_release)
    return calls


def test_a_new_release_without_results(releases, cut, capsys):
    assert main(["release", "0.3.0", "--no-results", "--accept", SPEC]) == 0
    ((version, tag, (acceptance,)),) = cut
    assert (version, tag, acceptance.spec) == ("0.3.0", True, SPEC)
    assert capsys.readouterr().out.splitlines() == [
        f"recorded release 0.3.0 = {'3' * 40} in releases.json, tagged v0.3.0",
        f"  no stored results; compare with {ELSEWHERE.format(v='0.3.0')}",
    ]
    assert main(["release", "0.3.1", "--no-results", "--no-tag"]) == 0
    assert cut[-1] == ("0.3.1", False, ())
    assert capsys.readouterr().out.splitlines()[0] == f"recorded release 0.3.1 = {'3' * 40} in releases.json"


def test_a_new_release_runs_its_suite_unless_told_not_to(releases, cut, monkeypatch, capsys):
    suites = []

    def fake_record_baseline(release, suite):
        suites.append(suite)
        return 1

    monkeypatch.setattr(release_command, "_record_baseline", fake_record_baseline)
    assert main(["release", "0.3.0"]) == 1  # the baseline run's exit code
    assert main(["release", "0.3.1", "--suite", "gpu"]) == 1
    assert suites == ["ci", "gpu"]


def test_a_release_that_cannot_be_cut_is_bad_input(releases, monkeypatch, capsys):
    def refuse(version, tag=True, accepted=()):
        raise ReleaseError("0.3.0: the checkout has uncommitted changes")

    monkeypatch.setattr(record, "cut_release", refuse)
    assert main(["release", "0.3.0"]) == 2
    assert capsys.readouterr().err == "moe-bench: error: 0.3.0: the checkout has uncommitted changes\n"


class FakeRunner:
    """Stands in for the runner: the outcomes are set by the test, nothing runs."""

    outcomes: ClassVar[list] = []

    def __init__(self, device, out_root):
        self.out_dir = REPO_ROOT / "results" / "0.3.0" / "cpu-m"
        self.machine = {"name": "cpu-m"}

    def run(self, scenarios):
        return self.outcomes


def outcome(name, status="ok", noisy=False):
    return SimpleNamespace(scenario=SimpleNamespace(name=name), status=status, noisy=noisy)


@pytest.mark.parametrize(
    ("outcomes", "code", "last"),
    [
        ([outcome("a"), outcome("b")], 0, None),
        (
            [outcome("a"), outcome("b", "failed"), outcome("c", noisy=True)],
            1,
            "  not ok or noisy: b, c: rerun them on a quiet machine before committing",
        ),
    ],
)
def test_the_baseline_run_is_recorded_and_a_bad_one_named(releases, monkeypatch, capsys, outcomes, code, last):
    monkeypatch.setattr(bench.run.runner, "Runner", FakeRunner)
    monkeypatch.setattr(FakeRunner, "outcomes", outcomes)
    monkeypatch.setattr(release_command, "resolve_device", lambda name: "cpu")
    monkeypatch.setattr(release_command, "suite_files", lambda suite, device: [f"{suite}.yaml"])
    monkeypatch.setattr(release_command, "load_all", lambda files: files)
    recorded = []

    def fake_record_baseline(version, machine, folder, path):
        recorded.append((version, machine, folder, path))
        return Release(version, "3" * 40, "2026-12-06")

    monkeypatch.setattr(record, "record_baseline", fake_record_baseline)
    assert release_command._record_baseline(Release("0.3.0", "3" * 40, "2026-12-06"), "ci") == code
    assert recorded == [("0.3.0", "cpu-m", "results/0.3.0/cpu-m", releases)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"  baseline: {len(outcomes)} scenario(s) of the ci suite in results/0.3.0/cpu-m; commit them with releases.json"
    )
    assert lines[-1] == f"  elsewhere: {ELSEWHERE.format(v='0.3.0')}"
    assert (lines[1] if last else None) == last


def test_version_prints_the_version_and_where_it_came_from(monkeypatch, capsys):
    found = SimpleNamespace(version="0.3.1.dev4+g0123abc", source="git describe: 4 commits after v0.3.0")
    monkeypatch.setattr(release_command, "engine_version", lambda: found)
    assert main(["version"]) == 0
    assert capsys.readouterr() == ("0.3.1.dev4+g0123abc\n", "(git describe: 4 commits after v0.3.0)\n")
