# imgserve: the HTTP image-model server on a CUDA runtime base (it falls back to CPU where no GPU is visible).
#   docker build -t imgserve:0.1.0 .
#   docker run --rm --gpus all --shm-size=1g -p 127.0.0.1:8000:8000 imgserve:0.1.0
# The CUDA base and the PyTorch wheel index must name the same CUDA release (12.8 <-> cu128).
# Another Debian/Ubuntu base and torch build are build arguments (tests/containers.py builds a CPU image that way):
#   --build-arg BASE_IMAGE=debian:bookworm --build-arg TORCH_VERSION=2.13.0+cpu \
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A machine with its own package mirror or CA passes pip's settings through (they are not kept in the image):
#   --build-arg PIP_INDEX_URL=... --build-arg PIP_EXTRA_INDEX_URL=... --build-arg PIP_FIND_LINKS=...
#   --build-arg PIP_CERT=/host-ca.crt -v /path/to/ca.crt:/host-ca.crt:ro
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# checkov:skip=CKV_DOCKER_7: the base is a build argument; its default above is a pinned tag, never latest
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu's archive keeps only the newest build of each package, so exact apt pins break the build within weeks;
# the base image tag pins the release instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv tini ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin imgserve

# torch first, from the PyTorch index built for the base image's CUDA: the largest layer, and the one that changes least.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The other dependencies from pyproject.toml alone (with the NVIDIA and OpenTelemetry extras, so the chart's `tracing`
# works), so editing the code does not reinstall them.
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu'] + p['optional-dependencies']['tracing']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The package itself, with the built-in model's weights (package data), so the default model needs no download.
COPY README.md ./
COPY service ./service
RUN pip install --no-deps . \
    && rm -rf /src/build /src/*.egg-info

WORKDIR /tmp
USER 10001:10001
# HTTP (/predict, /v2, health, metrics) and the Open Inference Protocol's gRPC service.
EXPOSE 8000 8001

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('IMGSERVE_PORT', '8000') + '/health/live', timeout=4)"]

# tini reaps zombies and forwards SIGTERM to imgserve only (no -g): imgserve drains and stops its own workers.
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["imgserve", "serve"]
