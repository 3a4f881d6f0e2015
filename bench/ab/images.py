"""Release comparison through images: the same suite in each engine image (Docker SDK), then one table.
More: docs/gate-statistics.md.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench.gate.accept import Acceptance
from bench.gate.compare import DEFAULT_TOLERANCE, compare
from bench.gate.verdict import accept_changes
from bench.release.record import ReleaseError, load_releases
from bench.report.collect import VERSIONS_MANIFEST
from bench.report.page import build_report
from bench.results import ResultDocument, ResultFileError, load_results, write_text_atomic
from bench.units import format_number, format_ratio

logger = logging.getLogger(__name__)

CONTAINER_RESULTS = "/moe-results"
"""Where the results folder is mounted in each container (``moe-bench run --out`` points there)."""
SHM_SIZE = "8g"  # torch.distributed ranks of one scenario share tensors through /dev/shm


class VersionsError(ValueError):
    """The engine or an image is not usable (one line; nothing was run)."""


def connect() -> Any:
    """A Docker SDK client to a reachable engine (``DOCKER_HOST`` or the local socket)."""
    try:  # optional: the Docker SDK, needed only to compare images
        from docker.errors import DockerException

        import docker
    except ImportError:
        raise VersionsError("the Docker SDK for Python is not installed (pip install docker)") from None
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except DockerException as err:
        raise VersionsError(f"Docker engine unreachable at {where}: {_first_line(err)}") from None
    except Exception as err:  # requests/urllib3 errors that the SDK lets through
        raise VersionsError(f"Docker engine unreachable at {where}: {_first_line(err)}") from None
    return client


def check_images(client: Any, images: list[str]) -> None:
    """Every image must exist on the engine already (no implicit pulls)."""
    # optional: the Docker SDK (``connect`` checked it is there)
    from docker.errors import DockerException, ImageNotFound

    for image in images:
        try:
            client.images.get(image)
        except ImageNotFound:
            raise VersionsError(f"{image}: no such image on this Docker engine (build or pull it first)") from None
        except DockerException as err:
            raise VersionsError(f"{image}: {_first_line(err)}") from None


def host_has_gpus() -> bool:
    """NVIDIA GPUs on this host (nvidia-smi lists one)."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def container_user(out: Path) -> str:
    """Run as the owner of the results folder, so that the files on the host belong to them."""
    stat = out.stat()
    return f"{stat.st_uid}:{stat.st_gid}"


def run_image(client: Any, image: str, command: list[str], out: Path, gpus: bool) -> int:
    """``moe-bench COMMAND...`` in ``image`` with ``out`` mounted at CONTAINER_RESULTS; the exit code."""
    # optional: the Docker SDK (``connect`` checked it is there)
    from docker.types import DeviceRequest

    container = client.containers.run(
        image,
        command=command,
        volumes={str(out.resolve()): {"bind": CONTAINER_RESULTS, "mode": "rw"}},
        user=container_user(out),
        shm_size=SHM_SIZE,
        device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])] if gpus else None,
        environment={"CI": "1"},  # plain progress lines
        detach=True,
    )
    try:
        for chunk in container.logs(stream=True, follow=True):
            for line in chunk.decode(errors="replace").splitlines():
                logger.info(f"[{image}] {line}")
        return int(container.wait().get("StatusCode", 1))
    finally:
        container.remove(force=True)


def compare_versions(
    docs_by_image: dict[str, list[ResultDocument]],
    tolerance: float = DEFAULT_TOLERANCE,
    acceptances: list[Acceptance] | None = None,
) -> str:
    """A Markdown table: per scenario and gated metric, each image's median, and later images' ratio to the first
    (a change a release between them accepts, ``acceptances``, says accepted)."""
    images = list(docs_by_image)
    first = docs_by_image[images[0]]
    comparisons = {
        image: accept_changes(compare(first, docs_by_image[image], tolerance), None, acceptances or ())
        for image in images[1:]
    }
    labels = [f"{image} ({_version(docs_by_image[image])})" for image in images]
    keys: list[tuple[str, str, str]] = []
    cells: dict[tuple[str, str, str], dict[str, str]] = {}
    for image, comparison in comparisons.items():
        for row in comparison.rows:
            if row.better is None or row.base is None or row.cand is None:
                continue
            key = (row.scenario, row.metric, row.unit)
            if key not in cells:
                keys.append(key)
                cells[key] = {images[0]: format_number(row.base)}
            cells[key][image] = f"{format_number(row.cand)} (x{format_ratio(row.ratio)}, {row.verdict})"
    lines = ["| scenario | metric | unit | " + " | ".join(labels) + " |", "|---" * (3 + len(images)) + "|"]
    for key in keys:
        lines.append("| " + " | ".join([*key, *(cells[key].get(image, "-") for image in images)]) + " |")
    notes = [issue.describe() for comparison in comparisons.values() for issue in comparison.issues]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _version(docs: list[ResultDocument]) -> str:
    versions = sorted({d.version for d in docs})
    return ", ".join(versions) if versions else "no results"


def _first_line(err: BaseException) -> str:
    """The gist of an SDK error: the OS error inside a connection failure, else its first line."""
    text = str(err).strip() or type(err).__name__
    errno = re.search(r"\[Errno -?\d+\] ([^\"')]+)|Error\(-?\d+, '([^']+)'\)", text)
    return (errno[1] or errno[2]).strip() if errno else text.splitlines()[0][:300]


def run_versions(images: list[str], suite: str, out: Path, gpus: str = "auto") -> tuple[int, str]:
    """Check, run every image, compare, write the report. Returns (exit code, the table). Raises VersionsError first."""

    if len(images) < 2:
        raise VersionsError("give at least two images to compare")
    if len(set(images)) != len(images):
        raise VersionsError("an image is listed twice")
    client = connect()  # the SDK is importable from here on
    check_images(client, images)
    # optional: the Docker SDK (``connect`` checked it is there)
    from docker.errors import DockerException

    use_gpus = host_has_gpus() if gpus == "auto" else gpus == "all"
    out.mkdir(parents=True, exist_ok=True)
    docs_by_image: dict[str, list[ResultDocument]] = {}
    written: list[Path] = []
    failed = []

    reported: set[Path] = set()

    def skip(err: ResultFileError) -> None:
        if err.path not in reported:
            reported.add(err.path)
            logger.warning(f"versions: warning: {err}; skipped")

    for image in images:
        before = set(out.rglob("*.json"))
        logger.info(f"versions: running suite {suite!r} in {image}{' with all GPUs' if use_gpus else ''}")
        command = ["run", "--suite", suite, "--out", CONTAINER_RESULTS, "--no-plots"]
        try:
            code = run_image(client, image, command, out, use_gpus)
        except DockerException as err:  # the engine failed mid-way: report it, go on with the others
            logger.error(f"versions: {image}: {_first_line(err)}")
            code = -1
        new = sorted(set(out.rglob("*.json")) - before)
        written += new
        docs_by_image[image] = [d for path in new for d in load_results(path, on_bad_file=skip)]
        if code != 0:
            failed.append(image)
            logger.error(f"versions: {image} exited with code {code}")
    try:
        acceptances = [a for release in load_releases() for a in release.accepted]
    except ReleaseError as err:  # the report page says the same; the table goes on without acceptances
        logger.warning(f"versions: warning: {err}")
        acceptances = []
    table = compare_versions(docs_by_image, acceptances=acceptances)
    # The list of the images' result files first: they are one machine's, which the page's release
    # comparison prefers over stored results of other machines (bench.report.collect.same_machine_sources).
    (out / "report").mkdir(exist_ok=True)
    listed = "".join(f"{path.relative_to(out).as_posix()}\n" for path in written)
    write_text_atomic(out / VERSIONS_MANIFEST, listed)
    write_text_atomic(out / "report" / "versions.md", table)
    report = build_report(out, out / "report", on_warning=lambda text: logger.warning(f"versions: warning: {text}"))
    logger.info(f"versions: table {out / 'report' / 'versions.md'}, report {report.path}")
    return (1 if failed else 0), table
