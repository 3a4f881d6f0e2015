"""Checkpoints of an execute scenario: where they live, when they are taken, which one a resume loads,
and the step journal that keeps every step's figures across attempts.
More: docs/step-measurement.md.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.scenario import Scenario

FORMAT_VERSION = 1
SIDECAR = ".moe-checkpoint.json"  # hidden: result scans of the results root skip it
JOURNAL = "steps.jsonl"
_PREFIX, _PARTIAL = "step-", ".partial"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from or written: ``<path>: <reason>`` (nothing has run)."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """What the scenario's ``checkpoint`` section asks for, with its folder resolved."""

    every_steps: int
    """Save after every this many optimizer steps."""
    root: Path
    """Folder of the scenario's checkpoints and journal."""
    asynchronous: bool
    """Write in the background (only the host copy stalls training)."""
    keep: int
    """Complete checkpoints kept (the newest)."""


@dataclass(frozen=True)
class CheckpointRun:
    """What the runner asks of this run's checkpoints."""

    policy: CheckpointPolicy | None
    """When and where to save (the scenario's checkpoint section, ``policy_for``); None: no saves."""
    resume: Path | None
    """The checkpoint to start from; None: from the first step."""
    attempt: int = 1
    """This attempt's number in the scenario's journal."""


def policy_for(spec: dict[str, Any], out_root: Path) -> CheckpointPolicy | None:
    """The scenario's checkpoint policy (None without a ``checkpoint`` section); a relative folder is
    taken under the results root."""
    section = spec.get("checkpoint")
    if not section:
        return None
    folder = Path(section.get("dir") or Path("checkpoints") / spec["name"])
    root = folder if folder.is_absolute() else Path(out_root) / folder
    return CheckpointPolicy(section["every_steps"], root, section["async"], section["keep"])


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step:08d}"


def is_complete(path: Path) -> bool:
    return not path.name.endswith(_PARTIAL) and (path / ".metadata").is_file() and (path / SIDECAR).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints in ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def model_dict(config) -> dict[str, Any]:
    """A model config (``ModelConfig``) as the sidecar records it: plain JSON values."""
    return json.loads(json.dumps(config.to_dict(), default=lambda v: getattr(v, "value", str(v))))


def sidecar(path: Path) -> dict[str, Any]:
    return json.loads((path / SIDECAR).read_text())


# Fields of the model config that do not shape a tensor: a checkpoint loads whatever they are.
_NOT_SHAPE = {
    "routing",
    "routing_seed",
    "zipf_exponent",
    "aux_loss_weight",
    "z_loss_weight",
    "expert_bias_rate",
    "backend",
    "init_std",
    "rope_theta",
    "norm_eps",
}


def _shape_fields(model: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
    fields = {}
    for key, value in model.items():
        if isinstance(value, dict):
            fields.update(_shape_fields(value, f"{prefix}{key}."))
        elif key not in _NOT_SHAPE:
            fields[f"{prefix}{key}"] = value
    return fields


def resolve_resume(
    spec: dict[str, Any], model: dict[str, Any], policy: CheckpointPolicy | None, given: str | None
) -> Path:
    """The checkpoint ``--resume`` loads (``given``: a checkpoint, or a folder of them; None: the
    scenario's folder): complete, of this model's shapes. Raises ``CheckpointError``."""
    if given is None and policy is None:
        raise CheckpointError(f"{spec['name']}: --resume without a path needs the scenario's checkpoint section")
    if given is not None:
        path = Path(given)
    else:
        assert policy is not None  # the check above raised when both are None
        path = policy.root
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or folder")
    if not path.name.startswith(_PREFIX) and not (path / ".metadata").exists():
        found = complete_checkpoints(path)
        if not found:
            raise CheckpointError(f"{path}: holds no complete checkpoint")
        path = found[-1]
    if not is_complete(path):
        raise CheckpointError(f"{path}: incomplete checkpoint (its save did not finish)")
    try:
        saved = sidecar(path)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable {SIDECAR} ({err})") from None
    theirs, ours = _shape_fields(saved.get("model", {})), _shape_fields(model)
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            raise CheckpointError(
                f"{path}: a checkpoint of another model ({key} is {theirs.get(key)!r} there, "
                f"{ours.get(key)!r} in {spec['name']})"
            )
    return path


def check_writable(policy: CheckpointPolicy, resuming: bool) -> None:
    """The folder can take checkpoints, and a fresh run would not write over an earlier run's."""
    try:
        policy.root.mkdir(parents=True, exist_ok=True)
        probe = policy.root / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"{policy.root}: cannot write checkpoints ({err.strerror or err})") from None
    existing = complete_checkpoints(policy.root)
    if existing and not resuming:
        raise CheckpointError(
            f"{policy.root}: holds checkpoints of an earlier run (latest {existing[-1].name}); "
            "pass --resume to continue it, or choose another checkpoint.dir"
        )


# --------------------------------------------------------------------------------------------
# The journal
# --------------------------------------------------------------------------------------------


def read_journal(root: Path) -> list[dict[str, Any]]:
    path = root / JOURNAL
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return entries


def append_journal(root: Path, entry: dict[str, Any]) -> None:
    with open(root / JOURNAL, "a") as handle:
        handle.write(json.dumps(entry) + "\n")
        handle.flush()


def next_attempt(root: Path) -> int:
    return 1 + max((e.get("attempt", 0) for e in read_journal(root)), default=0)


def history(root: Path, before_step: int, attempt: int) -> tuple[list[dict], list[dict]]:
    """(the steps ``0 .. before_step - 1`` as the checkpoint's lineage ran them, every earlier attempt).

    A step run by several attempts (one that was killed after its last checkpoint redid some) is
    taken from the latest attempt that ran it before this one."""
    steps: dict[int, dict] = {}
    attempts: dict[int, dict] = {}
    for entry in read_journal(root):
        number = entry.get("attempt", 0)
        if number >= attempt:
            continue
        kind = entry.get("event")
        if kind == "step" and entry["step"] < before_step:
            steps[entry["step"]] = entry
        elif kind in ("start", "end", "checkpoint"):
            record = attempts.setdefault(number, {"attempt": number, "checkpoints": [], "steps_run": 0})
            if kind == "start":
                record["resumed_from_step"] = entry.get("resumed_from_step")
            elif kind == "end":
                record.update(status=entry.get("status"), error=entry.get("error"))
            else:
                record["checkpoints"].append(entry["step"])
        if kind == "step":
            attempts.setdefault(number, {"attempt": number, "checkpoints": [], "steps_run": 0})["steps_run"] += 1
    return [steps[s] for s in sorted(steps)], [attempts[a] for a in sorted(attempts)]


# --------------------------------------------------------------------------------------------
# Saving during a run
# --------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    step: int
    partial: Path
    started: float
    stall_s: float
    future: Future
    done_at: list = field(default_factory=list)


@dataclass
class SaveRecord:
    """One checkpoint of this run."""

    step: int
    save_s: float
    """From the save's start until the checkpoint was complete."""
    stall_s: float
    """What training waited for it (a sync save: all of it; async: the host copy)."""
    bytes_per_rank: list[int]
    """Bytes of the files each rank wrote."""


def rank_bytes(path: Path, world: int) -> list[int]:
    """Bytes each rank's files hold (DCP names them ``__<rank>_<n>.distcp``)."""
    sizes = [0] * world
    for file in path.glob("__*_*.distcp"):
        rank = int(file.name[2:].split("_", 1)[0])
        if rank < world:
            sizes[rank] += file.stat().st_size
    return sizes


class Checkpointer:
    """Takes the policy's checkpoints during a run; every rank makes one and calls it at every step."""

    def __init__(
        self,
        policy: CheckpointPolicy,
        save: Callable,
        async_save: Callable,
        rank: int,
        world: int,
        barrier: Callable[[], None],
        sidecar_fields: dict[str, Any],
    ):
        self.policy, self._save, self._async_save = policy, save, async_save
        self.rank, self.world, self._barrier = rank, world, barrier
        self._fields = sidecar_fields
        self.records: list[SaveRecord] = []
        self._pending: _Pending | None = None
        if rank == 0:
            for stale in policy.root.glob(f"{_PREFIX}*{_PARTIAL}"):
                shutil.rmtree(stale, ignore_errors=True)
        barrier()

    def due(self, steps_done: int) -> bool:
        return steps_done % self.policy.every_steps == 0

    def save(self, steps_done: int, extra: dict[str, Any]) -> float:
        """Checkpoint after ``steps_done`` steps; returns the seconds training stalled for it."""
        start = time.perf_counter()
        stall_prev = self._wait_pending()
        final = step_dir(self.policy.root, steps_done)
        partial = final.with_name(final.name + _PARTIAL)
        if self.rank == 0:
            partial.parent.mkdir(parents=True, exist_ok=True)
        if self.policy.asynchronous:
            future = self._async_save(partial, extra)
            stall = time.perf_counter() - start
            pending = _Pending(steps_done, partial, start, stall - stall_prev, future)
            future.add_done_callback(lambda _: pending.done_at.append(time.perf_counter()))
            self._pending = pending
            return stall
        self._save(partial, extra)
        self._barrier()
        self._finalize(steps_done, partial, start, time.perf_counter() - start)
        return time.perf_counter() - start

    def poll(self) -> None:
        """Finish an async save whose writes are done (the rename is rank 0's alone)."""
        if self._pending is not None and self._pending.future.done():
            self._wait_pending()

    def finish(self) -> list[SaveRecord]:
        self._wait_pending()
        return self.records

    def _wait_pending(self) -> float:
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        waited = time.perf_counter()
        pending.future.result()
        waited = time.perf_counter() - waited
        end = pending.done_at[0] if pending.done_at else time.perf_counter()
        self._finalize(pending.step, pending.partial, pending.started, pending.stall_s + waited, end - pending.started)
        return waited

    def _finalize(self, step: int, partial: Path, started: float, stall_s: float, save_s: float | None = None) -> None:
        final = step_dir(self.policy.root, step)
        save_s = save_s if save_s is not None else time.perf_counter() - started
        sizes = rank_bytes(partial, self.world) if self.rank == 0 else []
        self.records.append(SaveRecord(step, save_s, stall_s, sizes))
        if self.rank != 0:
            return
        document = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "bytes_per_rank": sizes,
            "async": self.policy.asynchronous,
            **self._fields,
        }
        (partial / SIDECAR).write_text(json.dumps(document, indent=1) + "\n")
        if final.exists():
            raise CheckpointError(f"{final}: exists already; a checkpoint is never written over")
        os.replace(partial, final)
        for old in complete_checkpoints(self.policy.root)[: -self.policy.keep]:
            shutil.rmtree(old, ignore_errors=True)


def checkpoint_metrics(records: list[SaveRecord], load_s: float | None) -> dict[str, list[float]]:
    """Samples of the checkpoint metrics (rank 0's records: it wrote the sidecars)."""
    samples: dict[str, list[float]] = {}
    if records:
        samples["checkpoint_save_s"] = [r.save_s for r in records]
        samples["checkpoint_stall_s"] = [r.stall_s for r in records]
        samples["checkpoint_bytes_per_rank"] = [float(max(r.bytes_per_rank)) for r in records[-1:]]
        samples["checkpoint_bytes_total"] = [float(sum(r.bytes_per_rank)) for r in records[-1:]]
    if load_s is not None and math.isfinite(load_s):
        samples["checkpoint_load_s"] = [load_s]
    return samples


def checkpoints_before_run(scenarios: Sequence[Scenario], resume: str | bool | None, out_root: Path) -> dict[str, Path]:
    """Before any step: the checkpoint each scenario resumes from (complete, of its model), and folders
    that can take checkpoints without writing over an earlier run's. Raises ValueError (one line)."""
    executes = [s for s in scenarios if s.mode == "execute"]
    given = resume if isinstance(resume, str) else None
    if given is not None and len(executes) != 1:
        raise ValueError(
            f"--resume {given}: names one checkpoint, for exactly one execute scenario ({len(executes)} given)"
        )
    targets: dict[str, Path] = {}
    for scenario in executes:
        policy = policy_for(scenario.spec, out_root)
        if resume is not None:
            targets[scenario.name] = resolve_resume(scenario.spec, model_dict(scenario.model), policy, given)
        if policy is not None:
            check_writable(policy, resuming=resume is not None)
    return targets
