"""Engine version strings, the release record, `moe-bench release` and `moe-bench versions` bad input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.cli import main
from bench.machine import checkout_info, engine_info, format_version
from bench.releases import Release, ReleaseError, cut_release, latest_release, load_releases, write_releases

SHA = "0123456789abcdef0123456789abcdef01234567"


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A throwaway git repository with three commits."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "--quiet", "--initial-branch=main")
    git(root, "config", "user.email", "t@example.com")
    git(root, "config", "user.name", "t")
    for i in range(3):
        (root / "code.py").write_text(f"x = {i}\n")
        git(root, "add", "code.py")
        git(root, "commit", "--quiet", "-m", f"c{i}")
    return root


def commits(root: Path) -> list[str]:
    return git(root, "rev-list", "--reverse", "HEAD").splitlines()


# --------------------------------------------------------------------------------------------
# Version strings
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "release, dirty, expected",
    [
        (("0.1.0", 0), False, "0.1.0"),
        (("0.1.0", 0), True, "0.1.0+0.g0123456.dirty"),
        (("0.1.0", 3), False, "0.1.0+3.g0123456"),
        (("0.1.0", 3), True, "0.1.0+3.g0123456.dirty"),
        (None, False, "0.2.0+g0123456"),
        (None, True, "0.2.0+g0123456.dirty"),
    ],
)
def test_format_version(release, dirty, expected):
    assert format_version("0.2.0", release, SHA, dirty) == expected


def test_versions_sort_between_releases():
    from packaging.version import Version

    ordered = ["0.1.0", "0.1.0+0.g0123456.dirty", "0.1.0+3.g0123456", "0.1.0+12.g0123456", "0.1.1"]
    assert sorted(ordered, key=Version) == ordered


def test_checkout_version_from_the_release_record(repo):
    """No tags fetched: the nearest release comes from releases.json; data files never make it dirty."""
    first, second, third = commits(repo)
    releases = [Release("0.1.0", first, "2025-01-01"), Release("0.2.0", second, "2025-02-01")]
    write_releases(releases, repo / "releases.json")
    info = checkout_info(repo, "9.9.9")
    assert info == {"version": f"0.2.0+1.g{third[:7]}", "git_commit": third, "git_dirty": False}
    git(repo, "checkout", "--quiet", second)
    (repo / "results").mkdir()
    (repo / "results" / "x.json").write_text("{}")
    git(repo, "add", "results/x.json")  # a staged result file is data, not a code change
    assert checkout_info(repo, "9.9.9")["version"] == "0.2.0"
    (repo / "code.py").write_text("changed\n")
    assert checkout_info(repo, "9.9.9")["version"] == f"0.2.0+0.g{second[:7]}.dirty"


def test_checkout_version_prefers_git_describe(repo):
    first, _, third = commits(repo)
    git(repo, "tag", "v0.3.0", first)
    assert checkout_info(repo, "9.9.9")["version"] == f"0.3.0+2.g{third[:7]}"


def test_checkout_version_before_any_release(repo):
    head = commits(repo)[-1]
    assert checkout_info(repo, "0.1.0")["version"] == f"0.1.0+g{head[:7]}"


def test_engine_info_outside_a_checkout(tmp_path, monkeypatch):
    """Not a checkout: the version the image build baked, else the package metadata."""
    from moe_engine import __version__

    assert engine_info(tmp_path) == {"version": __version__, "git_commit": None, "git_dirty": None}
    (tmp_path / "bench").mkdir()
    baked = {"version": "0.1.0+2.gabcdef0", "git_commit": SHA, "git_dirty": False}
    (tmp_path / "bench" / "engine.json").write_text(json.dumps(baked))
    assert engine_info(tmp_path) == baked


def test_this_checkout_has_a_described_version():
    info = engine_info()
    if info["git_commit"] is None:
        pytest.skip("not a git checkout (an installed package or a container image)")
    match = re.fullmatch(r"\d+(\.\d+)*(\+(\d+\.)?g(?P<sha>[0-9a-f]{7})(?P<dirty>\.dirty)?)?", info["version"])
    assert match, info["version"]
    assert match["sha"] in (None, info["git_commit"][:7]) and bool(match["dirty"]) == info["git_dirty"]


# --------------------------------------------------------------------------------------------
# The release record
# --------------------------------------------------------------------------------------------


def test_release_record_round_trip(tmp_path):
    path = tmp_path / "releases.json"
    assert load_releases(path) == [] and latest_release(path) is None
    write_releases([Release("0.10.0", SHA, "2025-03-01"), Release("0.2.0", SHA[::-1], "2025-02-01")], path)
    assert [r.version for r in load_releases(path)] == ["0.2.0", "0.10.0"]
    assert latest_release(path) == Release("0.10.0", SHA, "2025-03-01")


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "cannot read"),
        ('{"versions": []}', '"releases" list'),
        ('{"releases": [{"version": "0.1.0", "commit": "abc", "date": "d"}]}', "40-digit"),
        ('{"releases": [{"version": "zero", "commit": "%s", "date": "d"}]}' % SHA, "not a PEP 440 version"),
        ('{"releases": [{"version": "0.1.0+local", "commit": "%s", "date": "d"}]}' % SHA, "not a release version"),
        ('{"releases": [{"version": "0.1.0", "commit": "%s"}]}' % SHA, "version, commit and date"),
    ],
)
def test_release_record_errors(tmp_path, content, message):
    path = tmp_path / "releases.json"
    path.write_text(content)
    with pytest.raises(ReleaseError, match=message):
        load_releases(path)


def test_cut_release(repo, monkeypatch):
    import moe_engine

    monkeypatch.setattr(moe_engine, "__version__", "0.1.0")
    head = commits(repo)[-1]
    with pytest.raises(ReleaseError, match="differs from the package version"):
        cut_release("0.2.0", root=repo)
    (repo / "code.py").write_text("dirty\n")
    with pytest.raises(ReleaseError, match="uncommitted changes"):
        cut_release("0.1.0", root=repo)
    git(repo, "checkout", "--", "code.py")
    release = cut_release("0.1.0", root=repo)
    assert release.commit == head and load_releases(repo / "releases.json") == [release]
    assert git(repo, "rev-parse", "v0.1.0^{commit}") == head
    assert checkout_info(repo, "0.1.0")["version"] == "0.1.0"  # the modified record is not a code change
    with pytest.raises(ReleaseError, match="not newer"):
        cut_release("0.1.0", root=repo)


def test_release_command_lists_and_refuses_bad_versions(capsys):
    assert main(["release", "--latest"]) == 0
    assert main(["release", "not-a-version"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error:") and "PEP 440" in err


# --------------------------------------------------------------------------------------------
# moe-bench versions: bad input
# --------------------------------------------------------------------------------------------


def test_versions_unreachable_engine(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")  # nothing listens on the discard port
    out = tmp_path / "results"
    assert main(["versions", "moe-engine:0.1.0", "moe-engine:0.2.0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "moe-bench: error: Docker engine unreachable at tcp://127.0.0.1:9: Connection refused\n"
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


class _FakeImages:
    def __init__(self, present):
        self.present = present

    def get(self, name):
        from docker.errors import ImageNotFound

        if name not in self.present:
            raise ImageNotFound(f"No such image: {name}")


class _FakeClient:
    def __init__(self, present):
        self.images = _FakeImages(present)

    def ping(self):
        return True


def test_versions_missing_image_runs_nothing(tmp_path, monkeypatch, capsys):
    """One image of two is missing: exit 2 before the first container starts, nothing written."""
    import docker

    monkeypatch.setattr(docker, "from_env", lambda **kw: _FakeClient({"moe-engine:0.1.0"}))
    started = []
    monkeypatch.setattr("bench.versions.run_image", lambda *a, **kw: started.append(a) or 0)
    out = tmp_path / "results"
    assert main(["versions", "moe-engine:0.1.0", "moe-engine:nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "moe-engine:nope: no such image on this Docker engine" in err
    assert started == [] and not out.exists()


def test_versions_missing_image_on_a_real_engine(tmp_path, capsys):
    from bench.versions import VersionsError, connect

    try:
        connect()
    except VersionsError as err:
        pytest.skip(f"no Docker engine reachable: {err}")
    out = tmp_path / "results"
    assert main(["versions", "moe-engine:does-not-exist-1", "moe-engine:does-not-exist-2", "--out", str(out)]) == 2
    assert "moe-engine:does-not-exist-1: no such image" in capsys.readouterr().err
    assert not out.exists()


def test_versions_needs_two_images(capsys):
    assert main(["versions", "moe-engine:0.1.0"]) == 2
    assert "at least two images" in capsys.readouterr().err


def test_compare_versions_table():
    from bench.results import ResultDocument, metric
    from bench.versions import compare_versions
    from result_docs import make_doc

    def docs(version, tput):
        m = {"tokens_per_s_per_gpu": metric([tput, tput + 1, tput - 1], "tokens/s", "higher"),
             "loss": metric([1.0], "nats", None)}
        return [ResultDocument(make_doc("s", m, version=version))]

    table = compare_versions({"img:a": docs("0.1.0", 1000), "img:b": docs("0.2.0", 500), "img:c": docs("0.3.0", 1000)})
    lines = table.splitlines()
    assert lines[0] == "| scenario | metric | unit | img:a (0.1.0) | img:b (0.2.0) | img:c (0.3.0) |"
    row = "| s | tokens_per_s_per_gpu | tokens/s | 1000 | 500 (x0.500, regressed) | 1000 (x1.000, unchanged) |"
    assert row in lines
    assert not any("loss" in line for line in lines)  # not gated: left out of the table



def test_run_stops_when_the_results_folder_is_not_writable(tmp_path, capsys):
    """In a container running as the wrong uid, the run stops before any work with one line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["run", "scenarios/smoke/e8-random-bf16.yaml", "--out", str(blocker / "results")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error:") and "results folder not writable" in err and "HOST_UID" in err
