"""The release record (releases.json) and `moe-bench release`."""

from __future__ import annotations

import pytest
from git_repo import SHA, commits, git

from bench.cli import main
from bench.gate.accept import parse_acceptance
from bench.release.record import (
    Release,
    ReleaseError,
    cut_release,
    latest_release,
    load_releases,
    record_acceptances,
    write_releases,
)
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
        (f'{{"releases": [{{"version": "zero", "commit": "{SHA}", "date": "d"}}]}}', "not a PEP 440 version"),
        (f'{{"releases": [{{"version": "0.1.0+local", "commit": "{SHA}", "date": "d"}}]}}', "not a release version"),
        (f'{{"releases": [{{"version": "0.1.0", "commit": "{SHA}"}}]}}', "version, commit and date"),
        (
            f'{{"releases": [{{"version": "0.1.0", "commit": "{SHA}", "date": "d", "accepted": "x"}}]}}',
            r"releases\[0\]\.accepted: expected a list",
        ),
        (
            f'{{"releases": [{{"version": "0.1.0", "commit": "{SHA}", "date": "d", "accepted": ["step_time_s@s: r"]}}]}}',
            r"releases\[0\]\.accepted\[0\]: 'step_time_s@s: r': no accepted size",
        ),
    ],
)
def test_release_record_errors(tmp_path, content, message):
    path = tmp_path / "releases.json"
    path.write_text(content)
    with pytest.raises(ReleaseError, match=message):
        load_releases(path)


ACCEPTED = "peak_tensor_bytes@e8-random-bf16,e8-ep2-nosync-bf16<=6%: fp32 gradient buffers"


def test_accepted_changes_are_kept_with_their_release(tmp_path):
    path = tmp_path / "releases.json"
    write_releases(
        [
            Release("0.1.0", SHA, "2025-01-01"),
            Release("0.2.0", SHA[::-1], "2025-02-01", (parse_acceptance(ACCEPTED, "0.2.0"),)),
        ],
        path,
    )
    first, second = load_releases(path)
    assert first.accepted == () and "accepted" not in path.read_text().split('"0.2.0"')[0]
    assert [a.spec for a in second.accepted] == [ACCEPTED] and second.accepted[0].release == "0.2.0"
    # Added to a release recorded before: once, with the release it belongs to.
    more = parse_acceptance("step_time_s@e8-skewed-fp32<=3%: clipping")
    updated = record_acceptances("0.1.0", (more, more), path)
    assert updated.accepted == (parse_acceptance(more.spec, "0.1.0"),)
    assert record_acceptances("0.1.0", (more,), path) == updated
    assert load_releases(path)[0] == updated and load_releases(path)[1] == second
    with pytest.raises(ReleaseError, match=r"0\.3\.0 is not a recorded release \(recorded: 0\.1\.0, 0\.2\.0\)"):
        record_acceptances("0.3.0", (more,), path)


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
    monkeypatch.setattr(moe_engine, "__version__", "0.2.0")
    (repo / "code.py").write_text("x = 3\n")
    git(repo, "commit", "--quiet", "-am", "c3")
    with_change = cut_release("0.2.0", root=repo, tag=False, accepted=(parse_acceptance(ACCEPTED),))
    assert with_change.accepted == (parse_acceptance(ACCEPTED, "0.2.0"),)
    assert load_releases(repo / "releases.json")[-1] == with_change


def test_release_command_lists_and_refuses_bad_versions(capsys):
    assert main(["release", "--latest"]) == 0
    assert main(["release", "not-a-version"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-bench: error:") and "PEP 440" in err
