"""Result documents for tests, valid against results/schema.json."""

from __future__ import annotations

from bench.results import SCHEMA_VERSION, scenario_hash

MACHINE = {
    "name": "1xnvidia-h200",
    "cpu_model": "Test CPU",
    "cpu_cores": 16,
    "gpu_name": "NVIDIA H200",
    "gpu_count": 1,
    "torch": "2.13.0",
    "triton": "3.4.0",
    "python": "3.11.0",
    "platform": "Linux",
}


def make_doc(
    name: str = "smoke-e8",
    metrics: dict | None = None,
    *,
    status: str = "ok",
    error: str | None = None,
    spec: dict | None = None,
    version: str = "0.1.0",
    machine: str = "1xnvidia-h200",
    timestamp: str = "2025-01-01T00:00:00Z",
) -> dict:
    spec = spec if spec is not None else {"mode": "execute", "experts": 8}
    if error is None and status != "ok":
        error = "boom"
    return {
        "schema_version": SCHEMA_VERSION,
        "engine": {"version": version, "git_commit": "0123456789abcdef0123", "git_dirty": False},
        "timestamp": timestamp,
        "machine": {**MACHINE, "name": machine},
        "scenario": {"name": name, "file": f"scenarios/{name}.yaml", "hash": scenario_hash(spec), "spec": spec},
        "mode": "execute",
        "status": status,
        "error": error,
        "metrics": metrics if metrics is not None else {},
    }


def refuse_reads(monkeypatch, path) -> None:
    """Make opening ``path`` fail with EACCES: chmod is no obstacle to root, so refuse the read itself."""
    from pathlib import Path

    real = Path.open

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
