"""What the commands of ``moe-bench`` share: exit codes, one-line errors, the output-folder check, the
``--accept`` and ``--accept-work`` options and reading one side of a comparison."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.gate.accept import check_metric_names, parse_acceptance
from bench.metrics import WORK_METRIC_NAMES
from bench.metrics import names as metric_names
from bench.release import record
from bench.results import load_nonempty

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

ACCEPT_WORK_HELP = (
    "accept an increase of these work counters (comma-separated work_* names; none given: "
    "every one): reported as accepted, not failed"
)
ACCEPT_HELP = (
    "accept a change made on purpose, METRIC[,METRIC...]@SCENARIO[,SCENARIO...]<=N%%: REASON, e.g. "
    "'peak_tensor_bytes@e8-random-bf16<=6%%: fp32 gradient buffers': a regression of those metrics on "
    "those scenarios at most N%% worse is reported as accepted with the reason (repeatable; the "
    "releases' own, from releases.json, apply where the versions compared span them)"
)


def fail(message: str) -> int:
    print(f"moe-bench: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def unwritable(out_root: Path) -> str | None:
    """Why the results folder cannot take results (None when it can); checked before any work."""
    folder = out_root
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return None
    owner = f"owned by uid {folder.stat().st_uid}" if folder.exists() else "missing"
    return (
        f"{out_root}: results folder not writable by uid {os.getuid()} ({folder} is {owner}); in a container, "
        "leave HOST_UID/HOST_GID unset (the run takes the folder's owner) or make the folder writable (see docs/install.md)"
    )


def parse_accept_options(specs: list[str], docs=(), with_releases: bool = True) -> list:
    """``--accept SPEC`` (each checked: its form, and a metric that is gated or in ``docs``), then the
    accepted changes of every recorded release (each applies only where its versions say). Raises
    ValueError (one line)."""

    given = []
    for spec in specs:
        try:
            given.append(parse_acceptance(spec))
        except ValueError as err:
            raise ValueError(f"--accept {err}") from None
    try:
        check_metric_names(given, docs)
    except ValueError as err:
        raise ValueError(f"--accept {err}") from None
    if not with_releases:
        return given
    return given + [a for release in record.load_releases(record.RELEASES_PATH) for a in release.accepted]


def load_side(path: str, skip_bad: bool = False):
    """The result documents of a file or folder. A file that cannot be read as a result document
    raises ResultFileError (a ValueError: one line naming the file and the reason); with
    ``skip_bad`` it is left out with a warning on stderr instead. No documents at all is bad input
    (``NoResultDocuments``, a ValueError)."""

    def warn(err) -> None:
        print(f"moe-bench: warning: {err}; skipped", file=sys.stderr)

    return load_nonempty(Path(path), on_bad_file=warn if skip_bad else None).docs


def accepted_work(value: str | None) -> frozenset[str] | None:
    """``--accept-work`` (every work metric) or ``--accept-work a,b``; unknown names are bad input."""
    if value is None:
        return None
    if value == "all":
        return frozenset(WORK_METRIC_NAMES)
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(names - set(WORK_METRIC_NAMES))
    if unknown:
        raise ValueError(
            f"--accept-work: unknown work metric {unknown[0]} (known: {', '.join(sorted(WORK_METRIC_NAMES))})"
        )
    return names


def accepted_increases(value: str | None) -> frozenset[str]:
    """``--accept-increase a,b``: exact metrics (not work counters, not timings) whose regression passes."""
    acceptable = metric_names(acceptable_increase=True)
    names = frozenset(n.strip() for n in (value or "").split(",") if n.strip())
    unknown = sorted(names - set(acceptable))
    if unknown:
        raise ValueError(
            f"--accept-increase: {unknown[0]} is not an exact metric the gate can accept "
            f"(known: {', '.join(acceptable)}; work counters: --accept-work)"
        )
    return names
