"""The few git queries the version label, the release record and the A/B gate share."""

from __future__ import annotations

import subprocess
from pathlib import Path

DATA_PATHS = ("results", "releases.json")
"""Data, not code: recording a release or writing results never makes a checkout "dirty"."""


class NotACheckout(Exception):
    """``root`` is not the top of a git checkout of its own (or git is missing): the reason."""


def git(root: Path, *args: str, timeout: float = 30) -> str:
    """stdout of ``git ARGS`` run in ``root``, stripped; raises ``subprocess.CalledProcessError`` on failure."""
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=timeout
    ).stdout.strip()


def try_git(root: Path, *args: str) -> str | None:
    """``git`` that answers None instead of raising (failed command, no git, not a repository)."""
    try:
        return git(root, *args)
    except (OSError, subprocess.SubprocessError):
        return None


def checkout_head(root: Path) -> tuple[str, bool]:
    """(HEAD commit, dirty) of the checkout whose top is ``root``; raises ``NotACheckout`` otherwise.

    Dirty means uncommitted changes to tracked files outside ``DATA_PATHS``.
    """
    root = Path(root)
    try:
        top = git(root, "rev-parse", "--show-toplevel")
    except FileNotFoundError:
        raise NotACheckout("git is not installed") from None
    except (OSError, subprocess.SubprocessError) as err:
        reason = (getattr(err, "stderr", None) or str(err)).strip().splitlines()
        raise NotACheckout(f"{root} is not a usable git checkout: {reason[-1] if reason else 'git failed'}") from None
    if Path(top).resolve() != root.resolve():
        raise NotACheckout(f"{root} is inside another repository ({top}), not a checkout of its own")
    commit = git(root, "rev-parse", "HEAD")
    excluded = [f":(exclude){path}" for path in DATA_PATHS]
    dirty = bool(git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded))
    return commit, dirty
