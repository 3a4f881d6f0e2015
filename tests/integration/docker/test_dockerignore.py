"""The image's build context holds the repository's own release results and nothing else of results/."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess

import pytest

from bench.results import REPO_ROOT


def _release_pattern() -> str:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    (pattern,) = [line[1:] for line in lines if line.startswith("!results/") and line != "!results/schema.json"]
    return pattern


def test_every_committed_release_folder_goes_into_the_image():
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout (inside the image the build dropped .git)")
    tracked = subprocess.run(
        ["git", "ls-files", "results"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    folders = {"/".join(path.split("/")[:2]) for path in tracked if path.count("/") >= 2}
    assert folders, "no committed release results"
    pattern = _release_pattern()
    # Go's filepath.Match, which the Docker engine uses, agrees with fnmatch on these character classes.
    missing = sorted(f for f in folders if not fnmatch.fnmatchcase(f, pattern))
    assert missing == [], f"extend .dockerignore's {pattern!r} to take {missing}"


def test_local_results_stay_out():
    pattern = _release_pattern()
    for local in ("results/0.2.0+31.gc011ee8.dirty", "results/my-run", "results/0.2.0+31.gc011ee8"):
        assert not fnmatch.fnmatchcase(local, pattern)
