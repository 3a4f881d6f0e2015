"""What the runner asks of a worker and what the worker answers, as one JSON file each way.

The runner (``bench.run.runner``) writes a ``WorkerRequest``: the scenario as run, the device, the
peaks MFU is measured against, the checkpoint run (its policy worked out once, by the runner) and
the devices a proxy result is also projected onto. The worker (``bench.run.worker``) reads it and
writes a ``WorkerOutcome``. What only the runner knows joins the outcome's details through
``merge_details``, which never overwrites a field the worker wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.machine import Peaks
from bench.run.checkpointing import CheckpointPolicy, CheckpointRun


@dataclass(frozen=True)
class WorkerRequest:
    """One scenario for a worker to run."""

    spec: dict[str, Any]
    """The scenario as run (``Scenario.spec``: every default filled in)."""
    file: str | None
    """The scenario's file, for messages; None for one built in memory."""
    device: str
    """The device the runner chose (``cpu``, ``cuda``); a rank of a launch takes its own GPU of that type."""
    peaks: Peaks = field(default_factory=Peaks)
    """What MFU is measured against (execute scenarios)."""
    checkpoint: CheckpointRun | None = None
    """The checkpoints to take and the one to resume from; None: neither."""
    project_devices: tuple[str, ...] = ()
    """Device profiles a proxy result is also projected onto, beside its cluster.device."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "spec": self.spec,
                "file": self.file,
                "device": self.device,
                "peaks": {"bf16": self.peaks.bf16, "fp8": self.peaks.fp8, "source": self.peaks.source},
                "checkpoint": _checkpoint_to_dict(self.checkpoint),
                "project_devices": list(self.project_devices),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> WorkerRequest:
        data = json.loads(text)
        return cls(
            spec=data["spec"],
            file=data["file"],
            device=data["device"],
            peaks=Peaks(**data["peaks"]),
            checkpoint=_checkpoint_from_dict(data["checkpoint"]),
            project_devices=tuple(data["project_devices"]),
        )


def _checkpoint_to_dict(run: CheckpointRun | None) -> dict[str, Any] | None:
    if run is None:
        return None
    policy = run.policy
    return {
        "policy": None
        if policy is None
        else {
            "every_steps": policy.every_steps,
            "root": str(policy.root),
            "asynchronous": policy.asynchronous,
            "keep": policy.keep,
        },
        "resume": str(run.resume) if run.resume else None,
        "attempt": run.attempt,
    }


def _checkpoint_from_dict(data: dict[str, Any] | None) -> CheckpointRun | None:
    if data is None:
        return None
    policy = data["policy"]
    return CheckpointRun(
        policy=None if policy is None else CheckpointPolicy(**{**policy, "root": Path(policy["root"])}),
        resume=Path(data["resume"]) if data["resume"] else None,
        attempt=data["attempt"],
    )


@dataclass(frozen=True)
class WorkerOutcome:
    """How a scenario's run ended, and what it measured."""

    status: str
    """ok, failed, oom or timeout (the result's status)."""
    error: str | None = None
    """Why it is not ok; None when it is."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The result's metrics (``bench.results.metric`` entries)."""
    details: dict[str, Any] = field(default_factory=dict)
    """The result's details, as the worker wrote them."""

    def to_json(self) -> str:
        return json.dumps(
            {"status": self.status, "error": self.error, "metrics": self.metrics, "details": self.details}
        )

    @classmethod
    def from_json(cls, text: str) -> WorkerOutcome:
        data = json.loads(text)
        return cls(data["status"], data["error"], data["metrics"], data["details"])


class DetailsClash(ValueError):
    """The runner would overwrite a field of the result's details that the worker wrote."""


def merge_details(worker: dict[str, Any], runner: dict[str, Any]) -> dict[str, Any]:
    """The worker's details with the runner's own fields after them; a field both wrote raises ``DetailsClash``."""
    clash = sorted(set(worker) & set(runner))
    if clash:
        raise DetailsClash(f"the runner would overwrite the worker's {', '.join(clash)} in the result's details")
    return {**worker, **runner}
