# moe-engine benchmark image: `docker compose run --rm bench` (see docker-compose.yml and README).
#
# BASE_IMAGE: a PyTorch image that carries torch and triton with CUDA. The default is the official
# pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime: the torch release CI pins (2.13.0), CUDA 13.0
# (Hopper and Blackwell, B300 included; GPU hosts need an NVIDIA driver >= 580), the triton that
# torch release was built with, and no compiler toolchain (the "devel" tag adds one; nothing here
# compiles CUDA code ahead of time; g++ is installed below for the compilers torch and Triton run).
# The same image runs on a CPU-only host: torch finds no GPU and
# the suites pick their CPU scenarios. Any image with python >= 3.10, pip and torch >= 2.8 works
# (e.g. MOE_BASE_IMAGE=moe-local-base:latest here): the base's torch and triton are never
# reinstalled.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# The image's own user: it owns the source tree and builds the version record. The containers
# start as root and docker/entrypoint.py runs the command as the owner of the mounted results
# folder (/opt/moe-engine/results, ./results in docker-compose.yml), so that results belong to
# whoever owns that folder on the host; this user only where no results folder says otherwise.
ARG UID=1000
ARG GID=1000

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    HOME=/home/moe \
    MPLCONFIGDIR=/home/moe/.config/matplotlib

RUN (getent group "${GID}" >/dev/null || groupadd --gid "${GID}" moe) \
 && (getent passwd "${UID}" >/dev/null || useradd --uid "${UID}" --gid "${GID}" --no-create-home --shell /bin/sh moe) \
 && mkdir -p /home/moe /opt/moe-engine && chown "${UID}:${GID}" /home/moe /opt/moe-engine && chmod 1777 /home/moe

WORKDIR /opt/moe-engine

# A C/C++ compiler and Python's headers at run time: torch.compile's inductor builds its CPU kernels
# with g++ against Python.h (run.compile on
# a CPU host, tests/unit/moe_engine/test_compile.py), and Triton compiles its small launcher with the C compiler on the
# first kernel of a GPU run. The runtime base images carry none.
RUN headers=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")/Python.h; \
    if ! command -v g++ >/dev/null || [ ! -f "$headers" ]; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
        $([ -f "$headers" ] || echo python3-dev) \
      && rm -rf /var/lib/apt/lists/*; fi

# The pinned light dependencies first (this layer survives code changes). base-torch.txt pins the
# base image's own torch (and triton) as constraints, so pip can never swap them.
COPY docker/constraints.txt docker/constraints.txt
RUN (python3 -m pip list --format=freeze | grep -iE '^(torch|triton)==' > /opt/base-torch.txt \
      || { echo "BASE_IMAGE must carry python3, pip and torch" >&2; exit 1; }) \
 && cat /opt/base-torch.txt \
 && python3 -m pip install -c /opt/base-torch.txt -r docker/constraints.txt

# The entrypoint (runs as root: root's file, outside the tree).
COPY docker/entrypoint.py /usr/local/bin/moe-entrypoint
RUN chmod 0755 /usr/local/bin/moe-entrypoint

# The project, editable: the suites, scenarios and result schema are read from this tree. Its
# dependencies are all satisfied by now, except triton on a base image without it.
COPY --chown=${UID}:${GID} . .
RUN python3 -m pip install -c /opt/base-torch.txt -c docker/constraints.txt -e ".[dev]" \
 && python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# Result documents are validated against results/schema.json, which a results folder mounted over
# results/ hides: the entrypoint gives this copy to a mounted folder that lacks one (a new one). A
# checkout without the file (./results deleted) gives the committed one where the base has git.
RUN f=/usr/local/share/moe-engine/results-schema.json && mkdir -p "${f%/*}" \
 && if [ -f results/schema.json ]; then cp results/schema.json "$f"; \
    elif command -v git >/dev/null && [ -e .git ]; then \
      git -c safe.directory="$PWD" show HEAD:results/schema.json > "$f" || rm -f "$f"; fi

USER ${UID}:${GID}
# The image has no .git: record the version of the checkout it was built from, then drop the
# history. ENGINE_RECORD, the host's own record of its checkout (docker-compose.yml passes
# MOE_ENGINE_RECORD: MOE_ENGINE_RECORD="$(python -m bench.release.version)" docker compose build),
# comes first: it needs no git in the base and works from a git worktree. Else git in the image;
# else nothing is recorded and results say <version>+unknown.
ARG ENGINE_RECORD=
RUN if [ -n "$ENGINE_RECORD" ] && printf '%s' "$ENGINE_RECORD" > /tmp/engine.json \
      && python3 -c "import json, sys; json.load(open(sys.argv[1]))['version']" /tmp/engine.json; then \
      mv /tmp/engine.json bench/engine.json && cat bench/engine.json; \
    elif command -v git >/dev/null && [ -e .git ] && python3 -m bench.release.version > /tmp/engine.json; then \
      mv /tmp/engine.json bench/engine.json && cat bench/engine.json; \
    else echo "no version recorded: results of this image are labelled <version>+unknown"; fi; rm -rf .git

# Root, for the entrypoint to pick the user (see above); `docker run --user` still overrides it.
USER root
ENTRYPOINT ["moe-entrypoint", "moe-bench"]
CMD ["run"]
