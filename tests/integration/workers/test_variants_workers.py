"""A variant run through real resident workers writes its document and leaves no worker behind."""

from __future__ import annotations

import json
import math
import os

import pytest
from own_processes import owned_processes, owned_processes_after, owner_env
from variant_scenario import write_tiny

from bench.ab import resident
from bench.validate import recompute_cost


@pytest.fixture
def tiny_file(tmp_path):
    return write_tiny(tmp_path)


# --- the rotation -------------------------------------------------------------------------------


# --- the summary arithmetic ---------------------------------------------------------------------


# --- the spec patches ---------------------------------------------------------------------------


def leaves(tree, prefix=()):
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(leaves(value, (*prefix, key)))
        return out
    return {prefix: tree}


# --- the measurement loop, with fake workers ----------------------------------------------------


# --- one real run -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_run_writes_its_document_and_leaves_no_worker_behind(tiny_file, tmp_path, monkeypatch):
    owner = owner_env()
    for name, value in owner.items():  # every worker and rank this test starts inherits the marker
        monkeypatch.setenv(name, value)
    sessions = []
    enter = resident.ResidentSide.__enter__

    def recording_enter(self):
        side = enter(self)
        sessions.append(os.getsid(side.process.pid))
        assert side.process.pid in owned_processes(owner)  # the marker reaches the workers
        return side

    monkeypatch.setattr(resident.ResidentSide, "__enter__", recording_enter)
    out = tmp_path / "out.json"
    code = recompute_cost.main(
        [
            str(tiny_file),
            "--variants",
            "full",
            "--no-control",
            "--pairs",
            "1",
            "--block-s",
            "0.05",
            "--timeout-s",
            "120",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    document = json.loads(out.read_text())
    assert {
        "command",
        "measured_at",
        "machine",
        "engine",
        "settings",
        "ratio",
        "control_note",
        "scenarios",
        "table",
    } <= set(document)
    assert [v["name"] for v in document["settings"]["variants"]] == ["full"]
    (row,) = document["scenarios"]
    assert row["status"] == "ok" and row["base"] == "none" and row["variants"] == ["full"]
    assert set(row["block_s"]) == {"none", "full"} and len(row["block_s"]["full"]) == 1
    ratio = row["ratios"]["full"]
    assert set(ratio) == {"per_pair", "median", "min", "max"} and math.isfinite(ratio["median"]) and ratio["median"] > 0
    assert set(row["peak_rss_mib"]) == {"none", "full"} and all(v > 0 for v in row["peak_rss_mib"].values())
    # Recompute replays the same forward: the probe step's losses agree.
    assert row["probe_loss_rel_diff"]["full"] < 1e-5
    assert "| tiny-variants | 1 | full vs none |" in document["table"]
    assert len(sessions) == 2
    assert owned_processes_after(owner) == []
