# syntax=docker/dockerfile:1
# Image of the DLRM serving pod: TorchServe and the sidecar run from this one image.
#
#   make model image               # GPU variant: dlrm-serve:0.1.0 (+ dlrm-serve:0.1.0-g<commit>)
#   make model image VARIANT=cpu   # CPU variant: dlrm-serve:0.1.0-cpu
#
# k8s/ deploys these images by digest (`make release-manifests`). It installs the
# serving packages only: requirements-serve.lock (hashes) + constraints.txt, no TorchRec, FBGEMM,
# test, load-test or lint tool (the pod imports none: tests/test_layers.py). Nothing
# secret goes in: the sidecar's tokens come from a Kubernetes Secret at run time and
# .dockerignore keeps .run/ out. SECURITY.md ("Supply chain") says how each pin is bumped.
#
# The base, pinned by digest: a tag can be re-pushed, a digest cannot. CPython 3.11.17 on
# Debian bookworm (the venv's minor version; tests/test_dockerfile.py wants a patch
# >= 3.11.14: 3.11.7 of Dec 2023 lacked the zipfile/tarfile fixes the sidecar's .mar
# reading needs). The digest is the one two public Dockerfiles pin for this tag; no
# registry is reachable from here, so it was NOT checked against Docker Hub: `make image`
# checks it first (`docker buildx imagetools inspect`, fails when it does not resolve) and
# prints the tag's current digest, which is how the base is refreshed (docs/release.md).
# Override with --build-arg PYTHON_IMAGE=python:3.11.x-slim-bookworm@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.11.17-slim-bookworm@sha256:0a310eeecf4e1f5a0743f9a6520c90c88d089c903ca5fd283f501e3a805f5f89
FROM ${PYTHON_IMAGE}

# gpu: PyPI's default torch build (CUDA); cpu: the CPU-only torch wheel (~200 MB instead
# of several GB). No FBGEMM in either: the exported program runs on plain torch.
ARG VARIANT=gpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# TEMP: TorchServe's launcher passes it to the JVM as java.io.tmpdir, where the .mar is
# unpacked; the pod mounts an emptyDir there because the root filesystem is read-only.
# LOG_LOCATION/METRICS_LOCATION: TorchServe's log4j writes there (another emptyDir).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    TEMP=/tmp \
    TMPDIR=/tmp \
    LOG_LOCATION=/opt/dlrm/logs \
    METRICS_LOCATION=/opt/dlrm/logs
# No OMP_NUM_THREADS: each worker sizes its torch threads from the container's CPU quota
# (serve/common/cpu.py); the variable would override that for every model.

# Java 17 runs TorchServe's frontend; tini (PID 1, -g) forwards SIGTERM to the whole
# process group, so both TorchServe's Python launcher and its JVM see it.
# Pinned Debian bookworm versions (`apt-cache policy` on bookworm; the JRE from
# bookworm-security). Debian keeps only the current version of a package: when a security
# update replaces this JRE the build fails with "Version ... was not found": bump the ARG
# to the new version (that is the point: a base update is a reviewed change).
ARG JRE_VERSION=17.0.21.1+2-1~deb12u1
ARG TINI_VERSION=0.19.0-1+b3
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       "openjdk-17-jre-headless=${JRE_VERSION}" "tini=${TINI_VERSION}" \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 dlrm \
    && useradd --system --uid 10001 --gid 10001 --home-dir /opt/dlrm --no-create-home \
       --shell /usr/sbin/nologin dlrm

WORKDIR /opt/dlrm
COPY requirements-serve.lock requirements-torch-cpu.lock constraints.txt ./
# Every install is hash-checked (--require-hashes: a file whose SHA-256 is not in the lock
# is refused) and constrained (-c constraints.txt), except the GPU variant's torch and the
# CUDA wheels it pulls (nvidia-*, triton): PyPI's, at torch's own pins, without hashes
# (SECURITY.md, "Supply chain"). Order: torch alone (the variant's build, --no-deps), then
# the serving lock (torch's dependencies included; pip trusts the torch already there),
# then, GPU only, torch's CUDA wheels. `make lock` writes both locks from the pins.
RUN set -eux; \
    python -m venv /opt/venv; \
    case "$VARIANT" in \
      cpu) pip install --require-hashes --no-deps -r requirements-torch-cpu.lock -c constraints.txt --index-url "$TORCH_CPU_INDEX" ;; \
      gpu) pip install --no-deps torch==2.13.0 -c constraints.txt ;; \
      *) echo "VARIANT must be gpu or cpu, got '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install --require-hashes -r requirements-serve.lock -c constraints.txt; \
    if [ "$VARIANT" = gpu ]; then pip install torch==2.13.0 -c constraints.txt; fi; \
    pip check

COPY pyproject.toml ./
COPY serve/ serve/
COPY handlers/ handlers/
RUN set -eux; \
    pip install --no-deps --no-build-isolation .; \
    python -c "import torch, ts, serve.sidecar.http.app, handlers.dlrm_handler"; \
    if python -c "import torchrec" 2>/dev/null || python -c "import fbgemm_gpu" 2>/dev/null; then \
      echo "the serving image must not contain torchrec or fbgemm_gpu" >&2; exit 1; fi

# Every model version `make model` built (model_store/dlrm-<V>.mar + dlrm-<V>.json; the
# archives a local sidecar derived for other batching are left out by .dockerignore).
# This is the pod's first model repository: the sidecar reads versions here, then on the
# dlrm-models volume, and copies the declared one into TorchServe's model store.
COPY model_store/ /opt/dlrm/model/
# Local defaults (loopback only); the pod mounts its own from k8s/configmap.yaml here.
COPY config.properties /etc/dlrm/config.properties
# TorchServe's logging: per-request lines off (log4j2.xml's header says why; the pod
# mounts the same file from k8s/configmap.yaml here).
COPY log4j2.xml /etc/dlrm/log4j2.xml
# logs: TorchServe's log4j; model-store: TorchServe's (writable) model store, where the
# sidecar puts the archives it registers (the pod mounts an emptyDir over it).
RUN mkdir -p /opt/dlrm/logs /opt/dlrm/model-store \
    && chown 10001:10001 /opt/dlrm/logs /opt/dlrm/model-store

USER 10001:10001
EXPOSE 8080 8082 8090 8091 8092
ENTRYPOINT ["/usr/bin/tini", "-g", "--"]
# TorchServe alone, with no model (no --models): the same command as the pod's torchserve
# container. What it serves is the sidecar's job: it reads the desired serving state and
# registers that version (k8s/deployment.yaml runs both). So a plain `docker run` of this
# image answers /ping but serves no model until a sidecar runs beside it; locally, `make
# run` starts both. One way to serve, the one the pod uses, rather than a second
# image-only path that would load a model without the serving state.
CMD ["torchserve", "--start", "--foreground", "--ts-config", "/etc/dlrm/config.properties", \
     "--log-config", "/etc/dlrm/log4j2.xml", \
     "--model-store", "/opt/dlrm/model-store", "--disable-token-auth", "--ncs"]
