# syntax=docker/dockerfile:1
# Image of the DLRM serving pod: TorchServe and the sidecar run from this one image.
#
#   make model image               # GPU variant: dlrm-serve:0.1.0
#   make model image VARIANT=cpu   # CPU variant: dlrm-serve:0.1.0-cpu
#
# k8s/ references exactly these tags (tests/test_dockerfile.py checks it). The pinned
# stack is the one scripts/setup_venv.sh installs: requirements.txt + constraints.txt,
# with torch, fbgemm and torchrec (--no-deps) first. Nothing secret goes in: the sidecar
# token comes from a Kubernetes Secret at run time and .dockerignore keeps .run/ out.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
FROM ${PYTHON_IMAGE}

# gpu: PyPI's default torch build (CUDA) and the CUDA fbgemm-gpu;
# cpu: the CPU-only torch wheel (~200 MB instead of several GB) and fbgemm-gpu-cpu.
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
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless tini \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 dlrm \
    && useradd --system --uid 10001 --gid 10001 --home-dir /opt/dlrm --no-create-home \
       --shell /usr/sbin/nologin dlrm

WORKDIR /opt/dlrm
COPY requirements.txt constraints.txt ./
RUN set -eux; \
    python -m venv /opt/venv; \
    case "$VARIANT" in \
      cpu) pip install torch==2.13.0 --index-url "$TORCH_CPU_INDEX"; \
           pip install fbgemm-gpu-cpu==1.8.0 -c constraints.txt ;; \
      gpu) pip install torch==2.13.0 fbgemm-gpu==1.8.0 -c constraints.txt ;; \
      *) echo "VARIANT must be gpu or cpu, got '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install --no-deps torchrec==1.8.0; \
    grep -v '^fbgemm-gpu' requirements.txt > /tmp/requirements-image.txt; \
    pip install -r /tmp/requirements-image.txt -c constraints.txt; \
    rm /tmp/requirements-image.txt

COPY pyproject.toml ./
COPY serve/ serve/
COPY handlers/ handlers/
RUN set -eux; \
    pip install --no-deps --no-build-isolation .; \
    if [ "$VARIANT" = cpu ]; then python -c "import torch, torchrec, fbgemm_gpu, serve"; fi

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
EXPOSE 8080 8082 8090
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
