"""The release record (releases.json) and `moe-bench release`."""

from __future__ import annotations

import pytest
from git_repo import SHA, commits, git

from bench.cli import main
from bench.release.record import Release, ReleaseError, cut_release, latest_release, load_releases, write_releases
from bench.release.version import checkout_version


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
    assert checkout_version(repo, "0.1.0").version == "0.1.0"  # the modified record is not a code change
    with pytest.raises(ReleaseError, match="not newer"):
        cut_release("0.1.0", root=repo)


def test_release_command_lists_and_refuses_bad_versions(capsys):
    assert main(["release", "--latest"]) == 0
    assert main(["release", "not-a-version"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error:") and "PEP 440" in err
