"""``python -m bench.validate.async_save_stall``: its report's arithmetic, and the slowed writer put back."""

from __future__ import annotations

import json
import logging
import statistics

import pytest
from torch.distributed.checkpoint import FileSystemWriter

from bench.validate import async_save_stall

pytestmark = pytest.mark.slow


def test_the_report_gives_the_stall_over_the_sync_save_and_restores_the_writer(tmp_path):
    original = FileSystemWriter.write_data
    out = tmp_path / "stall.json"
    assert async_save_stall.main(["--write-delay-s", "0", "--repeats", "3", "--out", str(out)]) == 0
    assert FileSystemWriter.write_data is original
    report = json.loads(out.read_text())
    assert len(report["sync_save_s"]) == len(report["async_stall_s"]) == 3
    sync, stall = statistics.median(report["sync_save_s"]), statistics.median(report["async_stall_s"])
    assert (report["sync_save_median_s"], report["async_stall_median_s"]) == (sync, stall)
    assert report["stall_ratio"] == pytest.approx(stall / sync, rel=1e-12)


def test_bad_settings_are_refused(caplog, capsys):
    assert async_save_stall.main(["--repeats", "0"]) == 2
    assert [r.levelno for r in caplog.records] == [logging.ERROR] and "--repeats must be positive" in caplog.text
    assert capsys.readouterr().out == ""  # nothing measured
