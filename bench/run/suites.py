"""What a run runs and where: the suites of ``scenarios/suites.yaml``, scenario files and folders,
every scenario loaded and validated before any work, and the device chosen."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from bench.scenario import SCENARIOS_DIR, Scenario, ScenarioError, load_scenario

if TYPE_CHECKING:
    import torch

SUITES_PATH = SCENARIOS_DIR / "suites.yaml"


def suite_files(name: str, device: torch.device) -> list[Path]:
    suites = yaml.safe_load(SUITES_PATH.read_text())
    suites.pop("comparisons", None)  # the pairs the summary compares (bench.report.comparisons), not a suite
    if name not in suites:
        raise ScenarioError(SUITES_PATH, name, f"no such suite (known: {', '.join(sorted(suites))})")
    entry = suites[name]
    patterns = entry.get("any") or entry.get("cuda" if device.type == "cuda" else "cpu") or []
    excluded = {f for pattern in entry.get("exclude", []) for f in SCENARIOS_DIR.glob(pattern)}
    files: list[Path] = []
    for pattern in patterns:
        files.extend(f for f in sorted(SCENARIOS_DIR.glob(pattern)) if f not in excluded)
    return files


def expand_paths(paths: list[str | Path]) -> list[Path]:
    """Files as given; folders expand to the YAML files below them."""
    files: list[Path] = []
    for path in map(Path, paths):
        files.extend(sorted(path.rglob("*.yaml")) if path.is_dir() else [path])
    return files


def load_all(files: list[Path]) -> list[Scenario]:
    """Load and validate every scenario, raising the first ScenarioError before any work."""
    scenarios = [load_scenario(f) for f in files]
    seen: dict[str, Path | None] = {}
    for s in scenarios:
        if s.name in seen:
            raise ScenarioError(s.file, "name", f"duplicate scenario name {s.name!r} (also {seen[s.name]})")
        seen[s.name] = s.file
    return scenarios


def resolve_device(choice: str) -> torch.device:
    import torch  # heavy: the commands that only read results never load it

    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ScenarioError(None, "--device", "cuda requested but no CUDA device is available")
    return torch.device(choice)
