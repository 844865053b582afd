# The Makefile is the interface: CI and people call only these targets.
# `make run` and `make test` work on a fresh machine (they install what they need).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROFILE ?= small
# make model: training seed (default: the profile's) and version name (default
# <profile>-<dtype>-s<seed>); each build adds an immutable version to model_store/.
SEED ?=
# The version `make model` builds and a new .run/state.yaml of `make up`/`make run` declares.
MODEL_ARGS = --profile $(PROFILE)$(if $(SEED), --seed $(SEED))$(if $(VERSION), --version $(VERSION))$(if $(filter 1 true yes,$(LABEL_SHUFFLE)), --label-shuffle)$(if $(MAPPING), --mapping $(MAPPING))$(if $(DENSE_PRECISION), --dense-precision $(DENSE_PRECISION))
MAPPING ?=
VERSION ?=
# make delta: the day of click logs the embedding delta trains on (>= 1).
DAY ?= 1
# `make run` / `make up` serve the declared version (.run/state.yaml), so they only need
# *a* version: their `model` step builds only when model_store/ holds none. Without
# this, any edit to the archive's sources would make their `make model` refuse to
# rebuild the existing default version (versions are immutable).
# run/up/bench/capacity serve a version that exists: build it only when that name is not
# in model_store/ (a new build is `make model`, which refuses to reuse a name for a
# different build).
run up bench-e2e bench-slo capacity faults fleet fleet-check oip-flood: MODEL_IF_MISSING := 1
SHAPE ?= step
DURATION ?= 60s
IMAGE ?= dlrm-serve
# The image's version: k8s/ deploys $(IMAGE):$(TAG) (tests/test_dockerfile.py checks it).
# Tags are immutable by convention: a version is built once, from a clean tree, and never
# pushed again with other content (bump TAG instead); each build is also tagged
# $(TAG)-g<commit> and labelled with the commit, so what runs is traceable.
TAG ?= 0.1.0
VARIANT ?= gpu
GIT_SHA := $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
export PYTHONUNBUFFERED := 1

.PHONY: help venv java kubectl prometheus chromium monitoring check docs promcheck model delta delta-check delta-compare bench-memory run up down test test-fast lint bench-runtime bench-e2e bench-switch bench-rollout faults feedback-check cache-advice \
        wrk bench-autotune bench-slo \
        gpu-check gpu-fixture bench-tiers loadtest capacity hpa-sim image lock release-manifests scan clean clean-models

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | column -t -s $$'\t'

$(VENV)/.stamp: requirements.txt requirements-dev.txt requirements-serve.txt constraints.txt pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PYTHON) bash scripts/setup_venv.sh
	@touch $@

venv: $(VENV)/.stamp  ## create .venv with the pinned stack

java:  ## install a Java runtime for TorchServe if missing
	@bash scripts/ensure_java.sh

kubectl:  ## install kubectl for the offline k8s tests if missing
	@bash scripts/ensure_kubectl.sh

prometheus:  ## install Prometheus 2.42 + promtool (Debian) for the rules and pipeline tests if missing
	@bash scripts/ensure_prometheus.sh

chromium:  ## install headless Chromium (Debian) for the /docs browser test if missing
	@bash scripts/ensure_chromium.sh

wrk:  ## install wrk (the load generator of make bench-autotune) if missing
	@bash scripts/ensure_wrk.sh

monitoring: venv  ## regenerate k8s/monitoring/ (rules, PrometheusRule, dashboard) from serve/ops/monitoring.py
	$(PY) -m serve.ops.monitoring --write

model: venv  ## add model version model_store/dlrm-<profile>-<dtype>-s<seed>[-shuffled].mar [PROFILE=small SEED= VERSION= LABEL_SHUFFLE=1: train on permuted labels, AUC ~0.5; STREAM=1 (0: never): merge/quantize streamed from the checkpoint within MAX_MEMORY_BYTES (default 2000000000), the default when the fp32 tables exceed half of it]; skips what is up to date
	$(PY) -m serve.model.pipeline $(MODEL_ARGS)$(if $(MODEL_IF_MISSING), --if-missing)$(if $(filter 1 true yes,$(STREAM)), --stream)$(if $(filter 0 false no,$(STREAM)), --no-stream)$(if $(MAX_MEMORY_BYTES), --max-memory-bytes $(MAX_MEMORY_BYTES))

delta: venv  ## build the next embedding delta of the serving version (or VERSION=) on day DAY=1's click logs: resumed embedding-only training, quantized like a full build; SIGN_KEY=FILE signs it (python -m serve.ops.keys generate); prints the .delta path last
	$(PY) -m serve.model.delta --day $(DAY)$(if $(VERSION), --version $(VERSION))$(if $(SIGN_KEY), --sign-key $(SIGN_KEY))

delta-check: venv  ## with `make up` running: make delta DAY=1, then day-1 AUC before/after POST /embeddings/deltas under load (8 x 512) -> bench/results/delta_check.json
	@set -o pipefail; path=$$($(PY) -m serve.model.delta --day $(DAY)$(if $(VERSION), --version $(VERSION)) | tee /dev/stderr | tail -1) && \
	$(PY) -m serve.ops.delta_check --delta "$$path" --day $(DAY)

bench-memory: venv java model  ## pod RSS/PSS with 2 and 4 workers, tables per worker vs shared -> bench/results/memory.json
	$(PY) -m bench.bench_memory

run: venv java model  ## build the default model if needed and serve it in the foreground (Ctrl-C stops); a new .run/state.yaml declares what `make model` builds (same PROFILE/SEED/VERSION/LABEL_SHUFFLE)
	$(PY) -m serve.ops.launcher run $(MODEL_ARGS)

up: venv java model  ## start the service in the background (a new .run/state.yaml declares what `make model` builds)
	$(PY) -m serve.ops.launcher up $(MODEL_ARGS)

down: venv  ## stop the background service
	$(PY) -m serve.ops.launcher down

.PHONY: fleet fleet-down fleet-check
PODS ?= 3
WORKERS ?= 1
fleet: venv java model  ## start a local fleet of PODS=3 pods (WORKERS=1 each) judging one rollout together; .run/fleet.json lists them
	$(PY) -m serve.ops.fleet up --pods $(PODS) --workers $(WORKERS)

fleet-down: venv  ## drain and stop the local fleet
	$(PY) -m serve.ops.fleet down --pods $(PODS)

fleet-check: venv java model  ## (long, not in make test) 3 pods roll back a bad canary together, a killed sidecar stays rolled back -> bench/results/fleet_check.json
	$(PY) -m serve.ops.fleet_check --pods $(PODS)

test: venv java kubectl prometheus chromium  ## run the test suite (CPU; GPU tests skip without CUDA)
	DLRM_REQUIRE_TOOLS=1 $(PY) -m pytest -q

test-fast: venv  ## unit tests only (no TorchServe, no slow, no promtool/kubectl/chromium: installs nothing)
	$(PY) -m pytest -q -m "not slow and not integration and not needs_promtool and not needs_kubectl and not needs_chromium"

lint: venv  ## ruff + mypy + pip-audit of the serving packages (AUDIT_STRICT=1: an unreachable vulnerability service fails too)
	$(VENV)/bin/ruff check serve handlers tests bench loadtest
	$(VENV)/bin/mypy serve handlers loadtest bench
	$(PY) -m serve.ops.audit$(if $(filter 1 true yes,$(AUDIT_STRICT)), --strict)

check: venv  ## rerun every generator (k8s/monitoring/, docs/configuration.md, docs/sidecar-api.md, docs/benchmarks/), fail if the tree changed (commit what they write), then make docs
	$(PY) -m serve.ops.monitoring --write
	$(PY) -m serve.ops.configdoc --write
	$(PY) -m serve.ops.apidoc --write
	$(PY) -m serve.ops.benchdoc --write
	@git diff --exit-code -- . || { echo "make check: the generators changed tracked files (above): commit them" >&2; exit 1; }
	@new=$$(git status --porcelain --untracked-files=all -- docs k8s/monitoring mkdocs.yml | grep '^??'); \
	if [ -n "$$new" ]; then echo "make check: generated files not in git: $$new" >&2; exit 1; fi
	@$(MAKE) --no-print-directory docs

# Strict: a warning (a broken link or anchor, a page missing from the nav) fails the build.
# Not --quiet: with --strict it hid the warnings that failed the build. Then the built site
# must load nothing from the internet (air-gapped readers): no script, stylesheet or font
# from another host.
docs: venv  ## build the documentation site docs/ -> site/ with MkDocs, strict (any warning fails), and check it loads nothing from the internet
	$(VENV)/bin/mkdocs build --strict --clean
	@ext=$$(grep -rIoE '<script[^>]*src="(https?:)?//[^"]*"|<link[^>]*href="(https?:)?//[^"]*"|@import[^;]*(https?:)?//[^;]*|url\((["'"'"']?)(https?:)?//[^)]*\)' site | sort -u); \
	if [ -n "$$ext" ]; then echo "make docs: the site loads from the internet:" >&2; echo "$$ext" >&2; exit 1; fi; \
	echo "make docs: site/ built, nothing loaded from the internet"

delta-compare: venv java  ## modulo vs managed id spaces: build both (small; small-hashed: its ids as 63-bit hashes, as raw logs carry them; small-half: tables half the id universe), each day-1 delta applied live under load, day-1 AUC before/after -> bench/results/delta_compare.json (~25 min)
	$(PY) -m bench.delta_compare

bench-runtime: venv  ## in-process runtime vs TorchRec throughput and cache hit ratios -> bench/results/runtime.json
	$(PY) -m bench.bench_runtime

bench-switch: venv  ## with `make up` running: live batch and version changes under load -> bench/results/switch.json
	$(PY) -m bench.bench_switch

bench-autotune: venv wrk  ## with `make up` running: the batching tuner vs a static sweep on single, ranking and mixed traffic (wrk; ~15 min) -> bench/results/autotune.json
	$(PY) -m bench.bench_autotune

ts-limits: venv java model  ## TorchServe's frontend limits: 64 clients posting 31 MiB bodies beside valid requests for 60 s (LIMITS_S=N) -> bench/results/ts_limits.json
	$(PY) -m bench.ts_limits --seconds $(or $(LIMITS_S),60)

.PHONY: ts-limits

ts-heap: venv java  ## TorchServe's heap: 200 connections trickling in-limit bodies + both version queues full during a switch, beside valid requests, 60 s (HEAP_S=N) -> bench/results/ts_heap.json
	$(PY) -m bench.ts_heap --seconds $(or $(HEAP_S),60)

.PHONY: ts-heap

oip-flood: venv java model  ## the OIP port cannot take a pod out: 150 stalled 8 MiB uploads + 8 bad-body clients for 60 s (OIP_FLOOD_S=N) under the pod's cgroup limits (root), probes and 8080 polled -> bench/results/oip_flood.json
	$(PY) -m bench.oip_flood --seconds $(or $(OIP_FLOOD_S),60) $(OIP_FLOOD_ARGS)

.PHONY: oip-flood

faults: venv java model  ## fault suite against a real service under load (kill -9, SIGTERM, slow clients, burst, soak; SOAK=600 s) -> bench/results/faults.json
	$(PY) -m serve.ops.faults $(MODEL_ARGS)$(if $(SOAK), --soak-s $(SOAK))$(if $(CASES), --cases $(CASES))

bench-rollout: venv  ## with `make up` running (+ make model SEED=7, SEED=8 LABEL_SHUFFLE=1): canary/shadow cost, guards -> bench/results/rollout.json
	$(PY) -m bench.bench_rollout

rollout-trials: venv java  ## do the default guards decide right? canaries (weight 0.2, bake 60 s) of a retrain (promoted), a shuffled-label model (rolled back) and a 1.5x slower candidate, under ranking load, on its own service (needs make model SEED=7 and SEED=8 LABEL_SHUFFLE=1; ~45 min at 20/20/2) -> bench/results/rollout_trials.json
	$(PY) -m bench.rollout_trials --trials $(or $(TRIALS),20) --bad-trials $(or $(BAD_TRIALS),20) --slow-trials $(or $(SLOW_TRIALS),2)

psi-calibration: venv  ## score PSI of every small-int8-s* retrain and shuffled-label model against small-int8-s0, on loadtest and on example traffic, per guard window (needs make model SEED=1,2,3,7 and SEED=8 LABEL_SHUFFLE=1) -> bench/results/psi_calibration*.json
	$(PY) -m bench.psi_calibration $(PSI_ARGS)
	$(PY) -m bench.psi_calibration --traffic example $(PSI_ARGS)

promcheck: venv prometheus  ## with `make up` running: a loopback Prometheus with our rules scrapes the sidecar under load; its QPS/p99 vs the load generator's -> bench/results/promcheck.json
	$(PY) -m serve.ops.promcheck

cache-advice: venv  ## with `make up` running: predicted LRU hit ratio against host/device capacity per worker (the curve from the workers' sampled reuse distances), current tiers predicted vs observed, memory for target hit ratios [CACHE_ADVICE_ARGS="--target 0.9 --json advice.json"]
	$(PY) -m serve.ops.cache_advice $(CACHE_ADVICE_ARGS)

feedback-check: venv  ## with `make up` running: held-out rows through the service, their labels to POST /feedback; online AUC/calibration vs the build baseline -> bench/results/feedback.json
	$(PY) -m serve.ops.feedback_check

bench-e2e: venv java model  ## HTTP end-to-end throughput/latency at the knee (p99 <= 60 ms; BENCH_E2E_ARGS="--no-p99-goal": where throughput stops rising) -> bench/results/e2e.json
	$(PY) -m bench.bench_e2e $(BENCH_E2E_ARGS)

BENCH_TIERS_ARGS ?=
bench-tiers: venv java  ## tables beyond memory: ranking traffic with Zipf ids (alpha 0.9, 1.05, 1.2) at host budgets 10/30/100% of the table bytes, hit ratios per tier, import time and peak RSS, start-up, disk per version (the article model, CI size; BENCH_TIERS_ARGS="--scale full --memory-limit-bytes 6e9" at full size) -> bench/results/tiers.json
	$(PY) -m bench.bench_tiers $(BENCH_TIERS_ARGS)

BENCH_SLO_ARGS ?=
bench-slo: venv java model  ## highest open-loop Poisson query rate (100-700 pairs/query) at p99 <= 60 ms on the real service, small + DLRM-v2 (needs make example-dlrmv2), vs in-process and the GEMM peak (~12 min on 2 cores, up to ~30 min where DLRM-v2 meets the goal) [BENCH_SLO_ARGS="--models small --min-duration-s 10"] -> bench/results/slo.json
	$(PY) -m bench.bench_slo $(BENCH_SLO_ARGS)

# The GPU machine has stock torch + pytest but no venv (and no TorchRec): use its python3.
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:  ## on a CUDA machine (no venv needed): gpu tests (CUDA paths vs CPU), then exactness, throughput, batch-1 latency
	$(GPU_PY) -m pytest -m gpu tests/test_gpu.py tests/test_idmap_managed.py tests/test_tiers_gpu.py -p no:cacheprovider --noconftest -q && $(GPU_PY) -m bench.gpu_check

LOADTEST_ARGS ?=
gpu-fixture: venv  ## regenerate bench/gpu_fixture/ (tiny int8 artifact + CPU expectations) for gpu-check
	$(PY) -m bench.make_gpu_fixture

loadtest: venv java  ## locust, headless: SHAPE=steady|step|spike|soak DURATION=60s [LOADTEST_ARGS="-H http://svc:8080 --allow-remote"]
	$(PY) -m loadtest.run --shape $(SHAPE) --duration $(DURATION) $(LOADTEST_ARGS)

capacity: venv java model  ## measure one instance's knee of the load-test mix; writes loadtest/capacity.json (not hpa.yaml)
	$(PY) -m serve.ops.capacity

hpa-sim: venv  ## replay single/ranking/mixed traffic through k8s/hpa.yaml and the old req/s spec; writes bench/results/hpa_sim.json
	$(PY) -m serve.ops.hpa_sim

IMAGE_SUFFIX = $(if $(filter cpu,$(VARIANT)),-cpu,)
# The Dockerfile's pinned base (name:tag@sha256:digest): `make image` checks it resolves.
PYTHON_IMAGE := $(shell sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)
image:  ## build the container image from a clean tree (needs a Docker engine and the registry): checks the pinned base digest resolves, then VARIANT=gpu|cpu; tags $(IMAGE):$(TAG)[-cpu] and $(IMAGE):$(TAG)-g<commit>[-cpu]
	@git diff --quiet HEAD -- . ':!model_store' || { echo "make image: the tree has uncommitted changes; an image tag names one commit: commit first" >&2; exit 1; }
	@docker buildx imagetools inspect "$(PYTHON_IMAGE)" >/dev/null || { echo "make image: the base $(PYTHON_IMAGE) does not resolve (no registry, no docker buildx, or the digest is wrong): see docs/release.md" >&2; exit 1; }
	@echo "make image: base $(PYTHON_IMAGE) resolves; its tag now points at: $$(docker buildx imagetools inspect "$(firstword $(subst @, ,$(PYTHON_IMAGE)))" --format '{{.Manifest.Digest}}' 2>/dev/null || echo '?') (a different digest: Debian or CPython updates; refresh the pin, docs/release.md)"
	docker build --build-arg VARIANT=$(VARIANT) -t $(IMAGE):$(TAG)$(IMAGE_SUFFIX) -t $(IMAGE):$(TAG)-g$(GIT_SHA)$(IMAGE_SUFFIX) --label org.opencontainers.image.version=$(TAG) --label org.opencontainers.image.revision=$(GIT_SHA) .

lock: venv  ## regenerate requirements-serve.lock and requirements-torch-cpu.lock (hashes the Dockerfile installs with --require-hashes) from the pins; needs the package index
	$(PY) -m serve.ops.lock

release-manifests: venv  ## after pushing $(IMAGE):$(TAG) and $(IMAGE):$(TAG)-cpu: write their digests into k8s/ (GPU_DIGEST=sha256:... CPU_DIGEST=sha256:..., else asked from the registry)
	$(PY) -m serve.ops.release --image $(IMAGE) --tag $(TAG)$(if $(GPU_DIGEST), --gpu-digest $(GPU_DIGEST))$(if $(CPU_DIGEST), --cpu-digest $(CPU_DIGEST))

scan: venv  ## vulnerability scan of $(IMAGE):$(TAG)[-cpu]: OS packages and jars (trivy, grype), serving packages (pip-audit --strict); says NOT SCANNED with the reason where a tool or registry is missing (SCAN_STRICT=1: that fails)
	$(PY) -m serve.ops.scan --image $(IMAGE):$(TAG)$(IMAGE_SUFFIX)$(if $(filter 1 true yes,$(SCAN_STRICT)), --strict)

clean:  ## remove build outputs, run state and logs (keeps .venv and the model versions in model_store/)
	rm -rf build .run logs

clean-models:  ## delete every model version in model_store/ (reports, archives, tables folders, and the archives TorchServe was given)
	rm -f model_store/*.json model_store/*.mar
	rm -rf model_store/*.tables model_store/*.tables.tmp-*

import: venv  ## import your own TorchRec model as a version: FACTORY=file.py:function CHECKPOINT=dcp-dir-or-state-dict VERSION=name [IMPORT_ARGS="--num-dense N --table-dtype t=fp16 ..."]
	@test -n "$(FACTORY)" -a -n "$(CHECKPOINT)" -a -n "$(VERSION)" || { echo "usage: make import FACTORY=file.py:function CHECKPOINT=PATH VERSION=NAME [IMPORT_ARGS=...]" >&2; exit 2; }
	$(PY) -m serve.model.importer --factory $(FACTORY) --checkpoint $(CHECKPOINT) --version $(VERSION) $(IMPORT_ARGS)

# Own-model examples: train a factory's model on generated data over 2 gloo ranks
# (serve.model.fit writes a torch.distributed.checkpoint), then import it as a version.
# Version names use '-' not '_' (serving versions match [A-Za-z0-9][A-Za-z0-9.-]*).
.PHONY: import examples example-dcn example-dlrmv2 example-ranker
EXAMPLE_STEPS ?= 20

examples: example-dcn example-dlrmv2 example-ranker  ## train and import all three own-model examples (examples/)

example-dcn: venv  ## examples/article_dcn (DLRM_DCN, 256 dense, user/item tables): fit on 2 ranks, import as article-dcn-int8 [EXAMPLE_STEPS=20]
	$(PY) -m serve.model.fit --factory examples/article_dcn/model.py:make_model --out build/examples/article_dcn/ckpt --world-size 2 --steps $(EXAMPLE_STEPS)
	$(PY) -m serve.model.importer --factory examples/article_dcn/model.py:make_model --checkpoint build/examples/article_dcn/ckpt --version article-dcn-int8

example-dlrmv2: venv  ## examples/dlrm_v2 (MLPerf DLRM-v2, rows capped at DLRMV2_MAX_ROWS=20000): fit on 2 ranks, import as dlrm-v2-int8
	$(PY) -m serve.model.fit --factory examples/dlrm_v2/model.py:make_model --out build/examples/dlrm_v2/ckpt --world-size 2 --steps $(EXAMPLE_STEPS) --dense-lr 0.001
	$(PY) -m serve.model.importer --factory examples/dlrm_v2/model.py:make_model --checkpoint build/examples/dlrm_v2/ckpt --version dlrm-v2-int8

example-ranker: venv  ## examples/own_ranker (hand-written TorchRec ranker: mixed dims, shared table, mean pooling): fit on 2 ranks, import as own-ranker-int8
	$(PY) -m serve.model.fit --factory examples/own_ranker/model.py:make_model --out build/examples/own_ranker/ckpt --world-size 2 --steps $(EXAMPLE_STEPS)
	$(PY) -m serve.model.importer --factory examples/own_ranker/model.py:make_model --checkpoint build/examples/own_ranker/ckpt --version own-ranker-int8

# Models at the scale users train, without training (docs/scale.md): random weights
# written chunk by chunk (memory: one chunk). The factories' own size options apply:
# ARTICLE_SCALE=full (the article's 100M x 64 + 50M x 32, a 29.6 GB checkpoint),
# DLRMV2_MAX_ROWS=0 (MLPerf's full rows, ~27 GB of int8 table files).
.PHONY: gen-checkpoint gen-version
GEN_OUT ?= build/generated/ckpt
GEN_ARGS ?=
gen-checkpoint: GEN_FACTORY ?= examples/article_two_tables/model.py:make_model
gen-version: GEN_FACTORY ?= examples/dlrm_v2/model.py:make_model

gen-checkpoint: venv  ## random-weight DCP checkpoint (as N ranks write it) to import with `make import` [GEN_FACTORY=examples/article_two_tables/model.py:make_model GEN_OUT=build/generated/ckpt ARTICLE_SCALE=full GEN_ARGS="--ranks 2 --seed 0"]
	$(PY) -m serve.model.generate checkpoint --factory $(GEN_FACTORY) --out $(GEN_OUT) $(GEN_ARGS)

gen-version: venv  ## random-weight version straight into model_store/ (quantized table files; for checkpoints too big for the disk) VERSION=name [GEN_FACTORY=examples/dlrm_v2/model.py:make_model DLRMV2_MAX_ROWS=0 GEN_ARGS="--dtype int8 --seed 0"]
	@test -n "$(VERSION)" || { echo "usage: make gen-version VERSION=NAME [GEN_FACTORY=file.py:function GEN_ARGS=...]" >&2; exit 2; }
	$(PY) -m serve.model.generate version --factory $(GEN_FACTORY) --version $(VERSION) $(GEN_ARGS)

# The Open Inference Protocol (KServe v2) with a stock client: tritonclient in a venv of
# its own (.oipenv), so the check imports nothing of ours, as a client would.
OIPENV := .oipenv
TRITONCLIENT_VERSION ?= 2.73.0
.PHONY: oip-check
$(OIPENV)/.stamp: Makefile
	$(PYTHON) -m venv $(OIPENV)
	$(OIPENV)/bin/pip install -q 'tritonclient[http]==$(TRITONCLIENT_VERSION)' numpy
	@touch $@

oip-check: $(OIPENV)/.stamp  ## with `make up` running: tritonclient (own venv .oipenv) is_server_ready, is_model_ready, binary infer of 512 instances == our API's probabilities (numpy.array_equal) -> bench/results/oip_check.json
	$(OIPENV)/bin/python scripts/oip_check.py --sidecar http://127.0.0.1:$${SIDECAR_PORT:-8090} \
		--predict-url http://127.0.0.1:$${TS_INFERENCE_PORT:-8080}/predictions/dlrm

# Own models end to end through the real service (serve/ops/import_check.py).
IMPORT_CHECK_ARGS ?=
.PHONY: import-check
import-check: venv java  ## own models end to end: fit (2 gloo ranks) -> import -> real TorchServe + sidecar on loopback: GET /state schema, HTTP == TorchRec quantized forward (<= 1e-6), 400s naming the feature, 0 5xx, a version switch under load with 0 failed -> bench/results/import_check.json [IMPORT_CHECK_ARGS="--examples own_ranker --keep"]
	$(PY) -m serve.ops.import_check $(IMPORT_CHECK_ARGS)
