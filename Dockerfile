# moe-engine benchmark image: `docker compose run --rm bench` (see docker-compose.yml and README).
#
# BASE_IMAGE: a PyTorch image that carries torch and triton with CUDA. The default is the official
# pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime: the torch release CI pins (2.13.0), CUDA 13.0
# (Hopper and Blackwell, B300 included; GPU hosts need an NVIDIA driver >= 580), the triton that
# torch release was built with, and no compiler toolchain (the "devel" tag adds one; nothing here
# compiles CUDA code ahead of time). The same image runs on a CPU-only host: torch finds no GPU and
# the suites pick their CPU scenarios. Any image with python >= 3.10, pip and torch >= 2.8 works
# (e.g. MOE_BASE_IMAGE=moe-local-base:latest here): the base's torch and triton are never
# reinstalled.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

# The non-root user the benchmarks run as. docker-compose.yml passes HOST_UID/HOST_GID (default
# 1000:1000) so that result files written into the mounted ./results belong to the host user.
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

# The pinned light dependencies first (this layer survives code changes). base-torch.txt pins the
# base image's own torch (and triton) as constraints, so pip can never swap them.
COPY docker/constraints.txt docker/constraints.txt
RUN (python3 -m pip list --format=freeze | grep -iE '^(torch|triton)==' > /opt/base-torch.txt \
      || { echo "BASE_IMAGE must carry python3, pip and torch" >&2; exit 1; }) \
 && cat /opt/base-torch.txt \
 && python3 -m pip install -c /opt/base-torch.txt -r docker/constraints.txt

# The project, editable: the suites, scenarios and result schema are read from this tree. Its
# dependencies are all satisfied by now, except triton on a base image without it.
COPY --chown=${UID}:${GID} . .
RUN python3 -m pip install -c /opt/base-torch.txt -c docker/constraints.txt -e ".[dev]" \
 && python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

USER ${UID}:${GID}
# The image has no .git: record the version of the checkout it was built from (when the base has
# git; otherwise the version is the package metadata's), then drop the history.
RUN if command -v git >/dev/null && [ -e .git ]; then python3 -m bench.machine > bench/engine.json \
      && cat bench/engine.json; fi; rm -rf .git

ENTRYPOINT ["moe-bench"]
CMD ["run"]
