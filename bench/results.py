"""Result documents: build, validate against results/schema.json, write atomically, load.
More: docs/results.md.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
"""Versions ``load_result`` reads; older ones are migrated to SCHEMA_VERSION in memory."""
REPO_ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO_ROOT / "results" / "schema.json"


class ResultValidationError(ValueError):
    """A result document does not match results/schema.json."""


class ResultFileError(ValueError):
    """A file that cannot be read as a result document; ``str()`` is one line: the file and the reason."""

    def __init__(self, path: Path, reason: str):
        self.path = Path(path)
        self.reason = " ".join(str(reason).split())  # one line, whatever the underlying message
        super().__init__(f"{self.path}: {self.reason}")


def metric(samples: Iterable[float], unit: str, better: str | None) -> dict[str, Any]:
    """A metric entry: samples, median and spread (min, max, interquartile range, relative IQR).

    One sample has no spread (``"spread": None``): a single value (a peak, a count, an estimate) is
    not a measurement of its own noise, and the gates compare it as an exact value.
    """
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("a metric needs at least one sample")
    median = statistics.median(values)
    spread = None
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        iqr = q3 - q1
        spread = {
            "min": min(values),
            "max": max(values),
            "iqr": iqr,
            "rel_iqr": abs(iqr / median) if median else 0.0,
        }
    return {"unit": unit, "better": better, "samples": values, "median": median, "spread": spread}


def scenario_hash(spec: dict[str, Any]) -> str:
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def scenario_file_entry(file: Path | str | None) -> dict[str, Any]:
    """A result's ``scenario.file`` and ``scenario.digest``: the file's path in the repository
    (``scenarios/smoke/x.yaml``), or its name alone for a file outside it, never where one machine keeps
    it; and the sha256 of its bytes, which names the file's content wherever it lies."""
    if file is None:
        return {"file": None}
    path = Path(file)
    try:
        where = path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        where = path.name
    try:
        digest: str | None = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        digest = None
    return {"file": where, "digest": digest}


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
    """Check ``data`` against results/schema.json (either readable version); ResultValidationError if not."""
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.path])
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.path) or "(document)"
        raise ResultValidationError(f"result document invalid at {where}: {first.message}")
    for name, entry in data["metrics"].items():
        if not all(math.isfinite(v) for v in entry["samples"]):
            raise ResultValidationError(f"metric {name}: non-finite sample")


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """A valid document in the shape of SCHEMA_VERSION (a copy when it had to change; see the module doc)."""
    if data["schema_version"] == SCHEMA_VERSION:
        return data
    data = copy.deepcopy(data)
    if data["schema_version"] == 1:
        for entry in data["metrics"].values():
            if len(entry["samples"]) == 1:
                entry["spread"] = None  # version 1 wrote iqr 0 for one sample: no spread was measured
        data["schema_version"] = 2
    return data


def result_dir(out_root: Path, version: str, machine: str) -> Path:
    return Path(out_root) / version / machine


def write_result(data: dict[str, Any], directory: Path) -> Path:
    """Validate, then write atomically (temp file in the same folder + rename) to a fresh file name."""
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ResultValidationError(
            f"result document invalid at schema_version: writes use version "
            f"{SCHEMA_VERSION}, got {data.get('schema_version')!r}"
        )
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


def write_text_atomic(path: Path, text: str) -> Path:
    """Replace ``path`` with ``text`` in one step (temp file in the same folder, fsync, rename): a reader
    sees the old file or the new one, never half of one; an interrupted write leaves the old file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def load_result(path: Path) -> ResultDocument:
    """Read, validate and migrate one document; ResultFileError (file and reason, one line) if it cannot."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ResultFileError(path, f"cannot read: {err.strerror or err}") from None
    try:
        data = json.loads(raw)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ResultFileError(path, f"not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ResultFileError(
            path, f"not a result document: the JSON is {_JSON_TYPES.get(type(data), 'a value')}, not an object"
        )
    version = data.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > max(READABLE_SCHEMA_VERSIONS):
        raise ResultFileError(
            path,
            f"schema_version {version} is newer than this moe-bench reads "
            f"({', '.join(map(str, READABLE_SCHEMA_VERSIONS))}): update moe-bench",
        )
    try:
        validate(data)
    except ResultValidationError as err:
        raise ResultFileError(path, str(err)) from None
    return ResultDocument(migrate(data), path)


PROJECTIONS_DIR = "projections"
"""Where ``moe-bench project`` writes its documents (``results/projections/`` by default): projection
documents, not result documents, so the result loaders pass over any folder of this name."""


def result_files(root: Path) -> list[Path]:
    """The candidate result files under a folder: ``*.json`` but schema.json, hidden (temporary) files
    and the projection documents of ``moe-bench project`` (a ``projections`` folder)."""
    root = Path(root)
    return [
        p
        for p in sorted(root.rglob("*.json"))
        if p.name != "schema.json"
        and not p.name.startswith(".")
        and not p.is_dir()
        and PROJECTIONS_DIR not in p.relative_to(root).parts[:-1]
    ]


def load_results(root: Path, on_bad_file: Callable[[ResultFileError], None] | None = None) -> list[ResultDocument]:
    """Every result document under ``root`` (a file or a folder, searched recursively).

    A file that cannot be loaded raises ``ResultFileError``; with ``on_bad_file`` it is passed there
    instead and left out. A missing ``root`` raises FileNotFoundError; an empty folder gives [].
    """
    root = Path(root)
    if root.is_file():
        paths = [root]
    elif root.is_dir():
        paths = result_files(root)
    else:
        raise FileNotFoundError(f"{root}: no such file or folder")
    docs = []
    for path in paths:
        try:
            docs.append(load_result(path))
        except ResultFileError as err:
            if on_bad_file is None:
                raise
            on_bad_file(err)
    return docs


class NoResultDocuments(ValueError):
    """A file or folder that holds no readable result document: ``<root>: no result documents``."""


@dataclass(frozen=True)
class LoadedResults:
    """The readable documents under a root and the files left out as unreadable."""

    docs: list[ResultDocument]
    """Every document that loaded."""
    skipped: list[ResultFileError]
    """Files that could not be read as result documents, in file order."""


def load_nonempty(root: Path, on_bad_file: Callable[[ResultFileError], None] | None = None) -> LoadedResults:
    """Every result document under ``root``; ``NoResultDocuments`` when there is none, saying how many
    files were skipped. An unreadable file raises ``ResultFileError`` or, with ``on_bad_file``, is
    handed there (to warn) and skipped. A missing ``root`` raises FileNotFoundError."""
    skipped: list[ResultFileError] = []

    def skip(err: ResultFileError) -> None:
        skipped.append(err)
        if on_bad_file is not None:
            on_bad_file(err)

    docs = load_results(root, on_bad_file=skip if on_bad_file is not None else None)
    if not docs:
        unread = f" ({len(skipped)} unreadable file{'s' * (len(skipped) != 1)} skipped)" if skipped else ""
        raise NoResultDocuments(f"{root}: no result documents{unread}")
    return LoadedResults(docs, skipped)


def run_index(doc: ResultDocument) -> int:
    """The ``.N`` suffix ``write_result`` gives the N-th run of a scenario (``x.json`` is 1, ``x.2.json`` 2)."""
    if doc.path is None:
        return 1
    file_name = Path(doc.path).name
    stem = file_name[: -len(".json")] if file_name.endswith(".json") else file_name
    match = re.fullmatch(re.escape(doc.name) + r"\.(\d+)", stem)
    return int(match.group(1)) if match else 1


def written_at(doc: ResultDocument) -> datetime | None:
    """The document's timestamp (UTC when it names no zone); None when it cannot be read."""
    text = doc.data.get("timestamp", "")
    try:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp


def age_key(doc: ResultDocument) -> tuple:
    """Sort key, oldest first: by timestamp (an unreadable one oldest of all), then the run's ``.N``
    suffix (runs within one second), then the path."""
    stamp = written_at(doc)
    return (stamp is not None, stamp.timestamp() if stamp else 0.0, run_index(doc), str(doc.path or ""))


def noisy_reason(data: dict[str, Any]) -> str | None:
    """Why a result document was recorded noisy, one line (``bench.run.conditions``); None when it was
    quiet or records no conditions (written before results recorded them)."""
    found = data.get("conditions") or {}
    if not found.get("noisy"):
        return None
    return "; ".join(found.get("reasons") or ["recorded noisy"])


# Machine identity (bench.machine.machine_identity records it): compared here, where the gate and the
# report read documents without measuring anything.

IDENTITY_TOLERANCE = 0.10
"""Two results come from the same machine when their CPU model, cores, ISA flags and GPUs agree,
their memory within this fraction, and their calibration figures within it too. The calibration of
one quiet machine repeats within a few percent; two 2-core Xeon VMs of one label measured 15-20% apart."""


def identity_difference(
    base: dict[str, Any] | None, cand: dict[str, Any] | None, tolerance: float = IDENTITY_TOLERANCE
) -> str | None:
    """Why two results' machines differ (one line), or None when they are one machine within
    ``tolerance``. A side without an identity (a result written before identities were recorded)
    cannot be shown to be the same machine: that is a difference too, unless neither side has one."""
    if base is None and cand is None:
        return None
    if base is None or cand is None:
        side = "baseline" if base is None else "candidate"
        return f"the {side} records no machine identity (written before results did)"
    for key, label in (("cpu_model", "CPU"), ("cpu_cores", "cores"), ("isa_flags", "ISA flags")):
        if base.get(key) != cand.get(key):
            return f"{label} {_show(base.get(key))} vs {_show(cand.get(key))}"
    base_gpu, cand_gpu = base.get("gpu") or {}, cand.get("gpu") or {}
    for key in ("name", "count", "driver", "max_sm_clock_mhz", "max_memory_clock_mhz"):
        if base_gpu.get(key) != cand_gpu.get(key):
            return f"GPU {key.replace('_', ' ')} {_show(base_gpu.get(key))} vs {_show(cand_gpu.get(key))}"
    if _apart(base.get("memory_gib"), cand.get("memory_gib"), tolerance):
        return f"memory {base['memory_gib']} GiB vs {cand['memory_gib']} GiB"
    base_cal, cand_cal = base.get("calibration"), cand.get("calibration")
    if base_cal and cand_cal and _apart(base_cal["gflops"], cand_cal["gflops"], tolerance):
        ratio = cand_cal["gflops"] / base_cal["gflops"]
        return (
            f"calibration {base_cal['gflops']:.1f} vs {cand_cal['gflops']:.1f} GFLOP/s (x{ratio:.2f}, "
            f"beyond the {tolerance:.0%} one machine repeats within)"
        )
    return None


def _apart(a: float | None, b: float | None, tolerance: float) -> bool:
    if not a or not b:
        return False
    return abs(b / a - 1.0) > tolerance


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "+".join(value) or "none"
    return str(value)
