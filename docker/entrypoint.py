#!/usr/bin/env python3
"""The image's entrypoint: run COMMAND... as the owner of the results folder.

    moe-entrypoint moe-bench run ...        (the image's ENTRYPOINT; the test service runs pytest)

The image starts as root; the command runs as the first of these users:

1. HOST_UID and HOST_GID, when HOST_UID is set (HOST_GID defaults to HOST_UID): an explicit choice;
2. the owner of the checkout (docker-compose.yml mounts it read-only at /run/moe-checkout), when
   the results folder is empty and root's: that is what the Docker engine makes for a missing
   ./results;
3. the owner of the results folder, /opt/moe-engine/results (docker-compose.yml mounts ./results
   there), root included: root on the host, or rootless Docker, where the host user appears as
   root; without the folder, the owner of the image's tree (the user it was built with).

So the files written to ./results belong to whoever owns ./results on the host. An empty results
folder of root's is handed to the user chosen by 1 or 2 first. Started as any other user
(`docker run --user`, `docker compose run --user`), the entrypoint changes nothing.

A results folder without schema.json (a new one) gets the image's copy: result documents are
validated against it. Whether the user can write to the folder is left to `moe-bench run`, which
stops with a one-line error before running anything.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import sys

RESULTS = "/opt/moe-engine/results"
TREE = "/opt/moe-engine"
CHECKOUT = "/run/moe-checkout"
SCHEMA = "/usr/local/share/moe-engine/results-schema.json"


def fail(message: str) -> None:
    print(f"moe-entrypoint: error: {message}", file=sys.stderr)
    sys.exit(2)


def owner(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_uid, stat.st_gid


def explicit_user() -> tuple[int, int] | None:
    uid, gid = os.environ.get("HOST_UID", "").strip(), os.environ.get("HOST_GID", "").strip()
    if not uid:
        return None
    if not uid.isdigit() or (gid and not gid.isdigit()):
        fail(f"HOST_UID and HOST_GID must be numeric ids (got HOST_UID={uid!r}, HOST_GID={gid!r})")
    return int(uid), int(gid or uid)


def target_user() -> tuple[int, int]:
    chosen = explicit_user()
    if not os.path.isdir(RESULTS):
        return chosen or owner(TREE)
    folder = owner(RESULTS)
    # An empty folder of root's: what the Docker engine makes for a missing bind-mount source.
    made_by_engine = folder[0] == 0 and not os.listdir(RESULTS)
    if chosen is None:
        if not (made_by_engine and os.path.isdir(CHECKOUT)):
            return folder
        chosen = owner(CHECKOUT)
    if made_by_engine and chosen[0] != 0:
        with contextlib.suppress(OSError):  # a read-only mount: moe-bench reports the folder
            os.chown(RESULTS, *chosen)
    return chosen


def become(uid: int, gid: int) -> None:
    """Drop root for uid:gid, with the user's groups where the image knows the user."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        entry = None
    if entry is not None:
        os.initgroups(entry.pw_name, gid)
    else:
        os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    # Some libraries name the user (getpass.getuser): give a user the image lacks a name.
    name = entry.pw_name if entry is not None else f"uid{uid}"
    os.environ.setdefault("USER", name)
    os.environ.setdefault("LOGNAME", name)


def seed_schema() -> None:
    target = os.path.join(RESULTS, "schema.json")
    if os.path.isdir(RESULTS) and os.path.isfile(SCHEMA) and not os.path.exists(target):
        with contextlib.suppress(OSError):  # not writable: moe-bench says so
            shutil.copyfile(SCHEMA, target)


def main(argv: list[str]) -> None:
    if not argv:
        fail("usage: moe-entrypoint COMMAND [ARG...]")
    if os.getuid() == 0:
        uid, gid = target_user()
        if (uid, gid) != (0, os.getgid()):
            become(uid, gid)
    seed_schema()
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        fail(f"{argv[0]}: {err.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
