from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from git_repo import make_repo


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A throwaway git repository with three commits."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    return make_repo(tmp_path / "repo")
