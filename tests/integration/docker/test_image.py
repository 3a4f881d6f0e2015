"""The image: build it from the Dockerfile and run a smoke scenario in it, results on a mounted folder.

Needs a Docker engine and the base image on it (``MOE_BASE_IMAGE``, else the Dockerfile's default);
skipped with the reason otherwise. The first build takes minutes; later ones reuse the layer cache.
"""

from __future__ import annotations

import json
import os

import pytest
from image_build import build_or_skip

pytestmark = pytest.mark.slow

TAG = "moe-engine:pytest"
SCENARIO = "scenarios/smoke/e8-random-bf16.yaml"


def test_image_runs_a_smoke_scenario(tmp_path):
    from bench.ab.images import CONTAINER_RESULTS, VersionsError, connect, run_image

    try:
        client = connect()
    except VersionsError as err:
        pytest.skip(f"no Docker engine reachable ({err}): the image build and run is not tested here")
    image = build_or_skip(client, TAG)
    # The image starts as root and its entrypoint runs moe-bench as the owner of the results folder
    # (tests/integration/docker/test_entrypoint.py); started as a given user, as run_image does, it stays that user.
    assert image.attrs["Config"]["Entrypoint"] == ["moe-entrypoint", "moe-bench"]

    out = tmp_path / "results"
    out.mkdir()
    if os.getuid() == 0:  # results belong to the folder's owner: make that a normal user
        os.chown(out, 1000, 1000)
    lines: list[str] = []
    command = ["run", SCENARIO, "--out", CONTAINER_RESULTS, "--no-plots"]
    code = run_image(client, TAG, command, out, gpus=False, log=lines.append)
    assert code == 0, "\n".join(lines[-30:])

    written = sorted(out.rglob("e8-random-bf16.json"))
    assert len(written) == 1, "\n".join(lines[-30:])
    doc = json.loads(written[0].read_text())
    assert doc["status"] == "ok" and doc["metrics"]["tokens_per_s_per_gpu"]["median"] > 0
    assert written[0].parent.parent.name == doc["engine"]["version"]
    owner = out.stat().st_uid
    assert owner != 0
    assert all(p.stat().st_uid == owner for p in [written[0], written[0].parent, written[0].parent.parent])
