"""``moe-bench project --fallback-device``: a missing --device file (bench/gpu-check.sh's measured
profile, when its profile step failed) is replaced by the shipped profile, said on stderr and in the
document; anything else wrong with a --device stays bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from bench.cli import main
from bench.predict.device import DEVICES_DIR

SMALL = "scenarios/smoke/e8-ep2-nosync-bf16.yaml"


@pytest.mark.slow
def test_a_missing_profile_file_falls_back_and_says_so(tmp_path, capsys):
    missing = tmp_path / "device-profile.yaml"
    out = tmp_path / "projections"
    assert main(["project", SMALL, "--device", str(missing), "--fallback-device", "h100-sxm", "--out", str(out)]) == 0
    said = (
        f"{missing}: no such profile file; projected on the shipped profile h100-sxm "
        f"({DEVICES_DIR / 'h100-sxm.yaml'}) in its place (--fallback-device)"
    )
    captured = capsys.readouterr()
    # The warning comes first on stderr, once; the projection's progress lines follow it there.
    assert captured.err.splitlines()[0] == f"moe-bench: warning: {said}"
    assert captured.err.count(said) == 1
    assert f"  {said}\n" in captured.out
    assert [p.name for p in out.iterdir()] == ["e8-ep2-nosync-bf16.h100-sxm.json"]
    doc = json.loads((out / "e8-ep2-nosync-bf16.h100-sxm.json").read_text())
    assert doc["device"] == "h100-sxm" and doc["device_fallback"] == said and doc["assumptions"][-1] == said


def test_without_a_fallback_a_missing_file_is_bad_input(tmp_path, capsys):
    missing = tmp_path / "device-profile.yaml"
    assert main(["project", SMALL, "--device", str(missing), "--out", str(tmp_path / "projections")]) == 2
    assert capsys.readouterr().err == f"moe-bench: error: {missing}: no such profile file\n"
    assert not (tmp_path / "projections").exists()


def test_a_broken_profile_file_is_not_replaced(tmp_path, capsys):
    data = yaml.safe_load((DEVICES_DIR / "b200.yaml").read_text())
    del data["hbm_gbps"]
    bad = tmp_path / "device-profile.yaml"
    bad.write_text(yaml.safe_dump(data))
    code = main(["project", SMALL, "--device", str(bad), "--fallback-device", "h100-sxm", "--out", str(tmp_path / "p")])
    assert code == 2
    assert capsys.readouterr().err == f"moe-bench: error: {bad}: hbm_gbps: missing\n"


def test_an_unknown_fallback_is_bad_input(tmp_path, capsys):
    missing = tmp_path / "device-profile.yaml"
    code = main(["project", SMALL, "--device", str(missing), "--fallback-device", "h900", "--out", str(tmp_path / "p")])
    assert code == 2
    assert "--device: unknown device 'h900'" in capsys.readouterr().err
