"""Result documents: build, validate against results/schema.json, write atomically, load.

A document records one scenario run. Files live at ``results/<version>/<machine>/<scenario>.json``
and are never overwritten: a second run of the same scenario gets ``<scenario>.2.json`` and so on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import jsonschema

SCHEMA_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO_ROOT / "results" / "schema.json"


class ResultValidationError(ValueError):
    """A result document does not match results/schema.json."""


def metric(samples: Iterable[float], unit: str, better: str | None) -> dict[str, Any]:
    """A metric entry: samples, median and spread (min, max, interquartile range, relative IQR)."""
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("a metric needs at least one sample")
    median = statistics.median(values)
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        iqr = q3 - q1
    else:
        iqr = 0.0
    return {
        "unit": unit,
        "better": better,
        "samples": values,
        "median": median,
        "spread": {
            "min": min(values),
            "max": max(values),
            "iqr": iqr,
            "rel_iqr": abs(iqr / median) if median else 0.0,
        },
    }


def scenario_hash(spec: dict[str, Any]) -> str:
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ResultDocument:
    """Thin wrapper over the JSON dict, for the fields the tools read most."""

    data: dict[str, Any]
    path: Path | None = None

    @property
    def name(self) -> str:
        return self.data["scenario"]["name"]

    @property
    def version(self) -> str:
        return self.data["engine"]["version"]

    @property
    def machine(self) -> str:
        return self.data["machine"]["name"]

    @property
    def status(self) -> str:
        return self.data["status"]

    @property
    def metrics(self) -> dict[str, dict[str, Any]]:
        return self.data["metrics"]


def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def validate(data: dict[str, Any]) -> None:
    errors = sorted(jsonschema.Draft202012Validator(_schema()).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.path) or "(document)"
        raise ResultValidationError(f"result document invalid at {where}: {first.message}")
    for name, entry in data["metrics"].items():
        if not all(math.isfinite(v) for v in entry["samples"]):
            raise ResultValidationError(f"metric {name}: non-finite sample")


def result_dir(out_root: Path, version: str, machine: str) -> Path:
    return Path(out_root) / version / machine


def write_result(data: dict[str, Any], directory: Path) -> Path:
    """Validate, then write atomically (temp file in the same folder + rename) to a fresh file name."""
    validate(data)
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        # mkstemp creates 0600; results are meant to be read by others (and from the host, under Docker).
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        name = data["scenario"]["name"]
        for attempt in range(1, 10_000):
            target = directory / (f"{name}.json" if attempt == 1 else f"{name}.{attempt}.json")
            try:
                # link() fails if the target exists, so an existing result is never replaced.
                os.link(tmp, target)
                return target
            except FileExistsError:
                continue
        raise FileExistsError(f"no free result file name for {name} in {directory}")
    finally:
        os.unlink(tmp)


def load_result(path: Path) -> ResultDocument:
    data = json.loads(Path(path).read_text())
    validate(data)
    return ResultDocument(data, Path(path))


def load_results(root: Path) -> list[ResultDocument]:
    """Every result document under ``root`` (a file or a folder, searched recursively)."""
    root = Path(root)
    if root.is_file():
        return [load_result(root)]
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such file or folder")
    return [load_result(p) for p in sorted(root.rglob("*.json")) if p.name != "schema.json" and not p.name.startswith(".")]
