"""Engine version strings: from a checkout, from an image build's record, or unknown."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
from git_repo import SHA, commits, git
from packaging.version import Version

from bench.cli import main
from bench.release.record import Release, write_releases
from bench.release.version import checkout_version, engine_info, engine_version, format_version


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
    info = checkout_version(repo, "9.9.9").record()
    assert info == {"version": f"0.2.0+1.g{third[:7]}", "git_commit": third, "git_dirty": False}
    git(repo, "checkout", "--quiet", second)
    (repo / "results").mkdir()
    (repo / "results" / "x.json").write_text("{}")
    git(repo, "add", "results/x.json")  # a staged result file is data, not a code change
    assert checkout_version(repo, "9.9.9").version == "0.2.0"
    (repo / "code.py").write_text("changed\n")
    assert checkout_version(repo, "9.9.9").version == f"0.2.0+0.g{second[:7]}.dirty"


def test_checkout_version_prefers_git_describe(repo):
    first, _, third = commits(repo)
    git(repo, "tag", "v0.3.0", first)
    assert checkout_version(repo, "9.9.9").version == f"0.3.0+2.g{third[:7]}"


def test_checkout_version_before_any_release(repo):
    head = commits(repo)[-1]
    assert checkout_version(repo, "0.1.0").version == f"0.1.0+g{head[:7]}"


def test_engine_info_outside_a_checkout(tmp_path):
    """Not a checkout: the version the image build baked, else a version that is no release's."""
    from moe_engine import __version__

    assert engine_info(tmp_path) == {"version": f"{__version__}+unknown", "git_commit": None, "git_dirty": None}
    (tmp_path / "bench").mkdir()
    baked = {"version": "0.1.0+2.gabcdef0", "git_commit": SHA, "git_dirty": False}
    (tmp_path / "bench" / "engine.json").write_text(json.dumps(baked))
    assert engine_info(tmp_path) == baked


def test_a_worktree_copied_without_its_repository_is_no_release(tmp_path, repo):
    """An image built from a ``git worktree``: its ``.git`` file points outside the build context."""
    from moe_engine import __version__

    first = commits(repo)[0]
    git(repo, "tag", "v0.1.0", first)
    worktree = tmp_path / "worktree"
    git(repo, "worktree", "add", "--quiet", str(worktree), first)
    assert checkout_version(worktree, "0.1.0").version == "0.1.0"  # the worktree itself knows its commit
    context = tmp_path / "context"  # what a docker build sees: the files, the .git pointer, no repository
    shutil.copytree(worktree, context)
    assert (context / ".git").is_file()
    shutil.rmtree(repo)
    version = engine_version(context)
    assert version.version not in {"0.1.0"} and version.version.endswith("+unknown")
    assert Version(version.version).public == __version__ and Version(version.version).local == "unknown"
    assert "no provenance" in version.source and "not a usable git checkout" in version.source


def test_version_command_says_why(tmp_path, monkeypatch, capsys, caplog):
    import bench.release.version as module

    monkeypatch.setattr(module, "REPO_ROOT", tmp_path)
    assert main(["version"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("+unknown")
    assert "no provenance" in err and "bench/engine.json" in err
    assert module._main() == 1  # the image build bakes nothing outside a checkout
    assert capsys.readouterr().out == ""
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.ERROR] == [
        "no version recorded"
    ]


def test_this_checkout_has_a_described_version():
    info = engine_info()
    if info["git_commit"] is None:
        pytest.skip("not a git checkout (an installed package or a container image)")
    match = re.fullmatch(r"\d+(\.\d+)*(\+(\d+\.)?g(?P<sha>[0-9a-f]{7})(?P<dirty>\.dirty)?)?", info["version"])
    assert match, info["version"]
    assert match["sha"] in (None, info["git_commit"][:7]) and bool(match["dirty"]) == info["git_dirty"]
