"""A throwaway git repository for the version and release tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def make_repo(root: Path) -> Path:
    """A repository at ``root`` with three commits of ``code.py``."""
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
