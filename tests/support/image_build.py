"""Building the project's image for the Docker tests: on the base image the run names, or skipped."""

from __future__ import annotations

import os
import re

import pytest

from bench.results import REPO_ROOT


def base_image() -> str:
    """``MOE_BASE_IMAGE``, else the Dockerfile's default base."""
    default = re.search(r"^ARG BASE_IMAGE=(\S+)", (REPO_ROOT / "Dockerfile").read_text(), re.M)[1]
    return os.environ.get("MOE_BASE_IMAGE") or default


def build_or_skip(client, tag: str):
    """The image built from this tree as ``tag``; skipped when the base image is not on the engine."""
    from docker.errors import BuildError, ImageNotFound

    base = base_image()
    try:
        client.images.get(base)
    except ImageNotFound:
        pytest.skip(f"base image {base} is not on this Docker engine: pull it, or set MOE_BASE_IMAGE to a local one")
    try:
        image, _ = client.images.build(path=str(REPO_ROOT), tag=tag, buildargs={"BASE_IMAGE": base}, rm=True)
    except BuildError as err:
        tail = "".join(chunk.get("stream", "") for chunk in err.build_log)[-3000:]
        pytest.fail(f"image build failed: {err.msg}\n{tail}")
    return image
