"""The image's entrypoint: results land on the mounted folder as the folder's owner, whoever that is.

``docker compose run --rm bench`` starts the image as root with ./results mounted at
/opt/moe-engine/results; the entrypoint runs moe-bench as the owner of that folder (root when root
owns it), so that the same command works for root and for a normal user, and the files on the host
belong to whoever owns ./results.

Needs a Docker engine and the base image on it (``MOE_BASE_IMAGE``, else the Dockerfile's default);
skipped with the reason otherwise. The folders are prepared and removed by root inside a helper
container, so the test itself may run as any user that can reach the engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from image_build import build_or_skip

pytestmark = pytest.mark.slow

TAG = "moe-engine:pytest-entrypoint"
RESULTS = "/opt/moe-engine/results"  # where docker-compose.yml mounts ./results
CHECKOUT = "/run/moe-checkout"  # where docker-compose.yml mounts the checkout, read-only
PLAN = "scenarios/olmo-core3/moe-8e-4.6b.yaml"  # a plan scenario: a result file in about a second
SMOKE = "scenarios/smoke/e8-random-bf16.yaml"


@pytest.fixture(scope="module")
def client():
    docker = pytest.importorskip("docker", reason="the Docker SDK for Python is not installed")
    try:
        engine = docker.from_env(timeout=60)
        engine.ping()
    except docker.errors.DockerException as err:
        pytest.skip(
            f"no Docker engine reachable ({str(err).splitlines()[0]}): the image's entrypoint is not tested here"
        )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def image(client):
    build_or_skip(client, TAG)
    yield TAG
    client.images.remove(TAG, noprune=True)


def run(
    client, image: str, command: list[str], volumes: dict, environment: dict | None = None, **options
) -> tuple[int, str]:
    """Run ``image`` to completion; its exit code and output. The container is always removed."""
    environment = {"CI": "1", **(environment or {})}  # CI: plain progress lines
    container = client.containers.create(
        image, command=command, volumes=volumes, environment=environment, shm_size="1g", **options
    )
    try:
        container.start()
        code = int(container.wait(timeout=600).get("StatusCode", 1))
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)


def as_root(client, image: str, where: Path, script: str) -> None:
    """``sh -c script`` as root in a helper container, with ``where`` mounted at /w."""
    code, output = run(
        client, image, ["-c", script], {str(where): {"bind": "/w", "mode": "rw"}}, entrypoint=["sh"], user="0:0"
    )
    assert code == 0, output


@pytest.fixture
def folders(client, image, tmp_path):
    """``make(name, uid, gid, mode)``: a folder under tmp_path with that owner and mode (root makes it)."""
    made = tmp_path / "made"
    made.mkdir()

    def make(name: str, uid: int, gid: int, mode: str = "755") -> Path:
        as_root(client, image, made, f"mkdir /w/{name} && chown {uid}:{gid} /w/{name} && chmod {mode} /w/{name}")
        return made / name

    yield made, make
    # The results belong to other users: root removes them, then hands the folder back to this user.
    as_root(client, image, made, f"rm -rf /w/* && chown {os.getuid()}:{os.getgid()} /w")


def result_files(out: Path, name: str) -> list[Path]:
    return sorted(out.rglob(f"{name}.json"))


def owners(out: Path) -> set[tuple[int, int]]:
    """(uid, gid) of everything under ``out``, ``out`` included."""
    return {(p.stat().st_uid, p.stat().st_gid) for p in [out, *out.rglob("*")]}


def bench_run(
    client, image: str, out: Path, scenario: str, mode: str = "rw", checkout: Path | None = None
) -> tuple[int, str]:
    """``moe-bench run SCENARIO`` as compose starts it: the image's user and entrypoint, ``out`` at RESULTS
    (``mode`` "ro": read-only), ``checkout`` at CHECKOUT."""
    volumes = {str(out): {"bind": RESULTS, "mode": mode}}
    if checkout is not None:
        volumes[str(checkout)] = {"bind": CHECKOUT, "mode": "ro"}
    return run(client, image, ["run", scenario, "--out", RESULTS, "--no-plots"], volumes)


def test_smoke_run_into_a_folder_root_owns(client, image, folders):
    """Root on the host (a cloud VM, a CI runner): ./results belongs to root, and so do the results."""
    _, make = folders
    out = make("results", 0, 0)
    code, output = bench_run(client, image, out, SMOKE)
    assert code == 0, output[-3000:]
    written = result_files(out, "e8-random-bf16")
    assert len(written) == 1, output[-3000:]
    doc = json.loads(written[0].read_text())
    assert doc["status"] == "ok" and doc["metrics"]["tokens_per_s_per_gpu"]["median"] > 0
    assert owners(out) == {(0, 0)}


@pytest.mark.parametrize("uid, gid", [(0, 0), (1000, 1000), (1234, 5678)])
def test_results_belong_to_the_folders_owner(client, image, folders, uid, gid):
    _, make = folders
    out = make("results", uid, gid)
    code, output = bench_run(client, image, out, PLAN)
    assert code == 0, output[-3000:]
    assert len(result_files(out, "moe-8e-4.6b")) == 1, output[-3000:]
    assert (out / "schema.json").is_file()  # a new folder gets the image's result schema
    assert owners(out) == {(uid, gid)}


def test_without_a_results_folder_the_images_user_runs(client, image):
    """The test service mounts no results folder: pytest runs as the image's own user, not as root."""
    code, output = run(
        client,
        image,
        ["-c", "import os; print(os.getuid(), os.getgid())"],
        {},
        entrypoint=["moe-entrypoint", "python3"],
    )
    assert code == 0, output
    assert output.split() == ["1000", "1000"]


def test_a_missing_folder_docker_creates_works(client, image, folders):
    """The engine creates a missing bind-mount source as root: the run works, as root."""
    made, _ = folders
    out = made / "results"
    code, output = bench_run(client, image, out, PLAN)
    assert code == 0, output[-3000:]
    assert len(result_files(out, "moe-8e-4.6b")) == 1, output[-3000:]
    assert owners(out) == {(0, 0)}


def test_a_folder_docker_created_goes_to_the_checkouts_owner(client, image, folders):
    """A normal user whose ./results was missing: the engine made it as root, empty; the results, and
    the folder, go to the owner of the checkout (mounted read-only as compose does), not to root."""
    made, make = folders
    checkout = make("checkout", 1000, 1000)
    out = made / "results"
    code, output = bench_run(client, image, out, PLAN, checkout=checkout)
    assert code == 0, output[-3000:]
    assert len(result_files(out, "moe-8e-4.6b")) == 1, output[-3000:]
    assert owners(out) == {(1000, 1000)}


def test_root_owned_results_are_left_to_root(client, image, folders):
    """Root-owned results that are already there are never handed to the checkout's owner."""
    _, make = folders
    checkout = make("checkout", 1000, 1000)
    out = make("results", 0, 0)
    as_root(client, image, out, "mkdir /w/earlier && touch /w/earlier/run.json")
    code, output = bench_run(client, image, out, PLAN, checkout=checkout)
    assert code == 0, output[-3000:]
    assert owners(out) == {(0, 0)}


def test_explicit_user_overrides_the_folders_owner(client, image, folders):
    """HOST_UID/HOST_GID (what docker-compose.yml passes on) pick the user, whoever owns the folder."""
    _, make = folders
    out = make("results", 1234, 1234, "777")
    command = ["run", PLAN, "--out", RESULTS, "--no-plots"]
    code, output = run(
        client,
        image,
        command,
        {str(out): {"bind": RESULTS, "mode": "rw"}},
        environment={"HOST_UID": "2345", "HOST_GID": "3456"},
    )
    assert code == 0, output[-3000:]
    assert {o for o in owners(out) if o != (1234, 1234)} == {(2345, 3456)}


@pytest.mark.parametrize("case", ["read-only mount", "owner without write permission"])
def test_a_folder_nobody_can_write_stops_with_one_line(client, image, folders, case):
    """Root in the container can write anywhere but on a read-only mount; a normal owner, not to mode 0555."""
    _, make = folders
    if case == "read-only mount":
        out = make("results", 0, 0)
        code, output = bench_run(client, image, out, PLAN, mode="ro")
    else:
        out = make("results", 1000, 1000, "555")
        code, output = bench_run(client, image, out, PLAN)
    assert code == 2, output[-3000:]
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("moe-bench: error: ") and "not writable" in errors[0], output
    assert list(out.iterdir()) == []
