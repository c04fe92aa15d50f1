# DSpark overlay recipe for vLLM 0.32.0 — see README.md. `make` alone prints this help.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROFILE ?= cpu-tiny
# The dev venv links the checkout's overlay files (one copy under test: an edit is live at once);
# OVERLAY_MODE= copies them, as the image and an existing install do.
OVERLAY_MODE ?= --link
TINY_MODEL := models/tiny-dsv4-dspark
# The cpu-4x twin's checkpoint: the tiny one with four attention output groups, so TP=4 divides.
TINY_TP4_MODEL := models/tiny-dsv4-dspark-tp4
CACHE := .cache
# Serving sweep sized for the CPU tiny server; on a Spark pass your own, e.g.
# BENCH_ARGS="--concurrency 1 4 16 --prompt-lens 256 2048 32768 --output-len 256".
# On a Spark (docker/.env present) `make bench` sweeps inside the head container with the
# second set: the Spark-sized default.
BENCH_ARGS ?= $(if $(wildcard $(SPARK_ENV)),--concurrency 1 4 8 --prompt-lens 256 2048 --output-len 256,\
  --concurrency 1 4 --prompt-lens 64 256 --output-len 32)
# The memory-bound twin's steps are slow on 2 cores: a smaller sweep for it (3 requests of 64
# tokens per level at c=1: one request of 32 swung the ratio by 0.2). Its servers run
# the engine in the API server's process: on two cores a separate engine-core process fights
# the API server and the client for them, which cost DSpark's steps 1.5-2x and plain ones 1.25x.
ifeq ($(PROFILE),cpu-membound)
BENCH_ARGS := --concurrency 1 4 --prompt-lens 128 --output-len 64 --rounds 3 --warmup 2 \
  --content prose code json
AB_ENV := VLLM_ENABLE_V1_MULTIPROCESSING=0
endif
# `make ab` configurations (default: DSpark vs no speculation, both started here).
AB_ARGS ?=

STAMP_DEPS := $(VENV)/.stamp-deps
STAMP_OVERLAY := $(VENV)/.stamp-overlay
OVERLAY_FILES := $(shell find overlay -type f ! -name '*.pyc' 2>/dev/null)
# Test-only oracle for the torch metadata kernels: stock triton, kept OUT of the product venv
# (vLLM would pick it up), put on PYTHONPATH only for the oracle tests' subprocesses.
TRITON_ORACLE := $(CACHE)/triton-oracle
VLLM_CPU_ENV := HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1

.PHONY: help setup demo serve test test-fast upstream-tests mutation bench ab lint apply revert check model model-membound \
        image selftest status up down logs smoke audit rehearse clean

help: ## this list
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | \
	  awk 'BEGIN {FS = ":.*## "} {printf "  make %-10s %s\n", $$1, $$2}'

setup: $(STAMP_OVERLAY) ## create .venv (pinned vllm-cpu + torch + dev tools) and apply the overlay

# .venv's interpreter: PYTHON when given (environment or command line), else the first of
# these whose version is in recipe/pins.yaml's python range (scripts/setup/find_python.sh).
VENV_PYTHON_CANDIDATES := $(if $(filter environment% command%,$(origin PYTHON)),$(PYTHON),\
  python3.11 python3.12 python3.13 python3.14 python3)

# The machine first (OS, architecture, disk, memory: one line and a stop in well under a
# second), then the interpreter (scripts/setup/check_host.sh, find_python.sh).
$(PY):
	scripts/setup/check_host.sh $(dir $(VENV)) && \
	py="$$(scripts/setup/find_python.sh $(VENV_PYTHON_CANDIDATES))" && \
	  "$$py" -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip || { rm -rf $(VENV); exit 1; }

# Pins come from recipe/pins.yaml, never written here. install_deps.py takes the `+cpu`
# torch from a local wheel if there is one, else from cpu.torch_index (TORCH_INDEX_URL).
$(STAMP_DEPS): recipe/pins.yaml pyproject.toml scripts/setup/install_deps.py | $(PY)
	@echo ">> installing pinned packages into $(VENV) (first run: a few minutes)"
	$(PY) -m pip install -q pyyaml
	@if [ -f $(STAMP_OVERLAY) ]; then scripts/apply_overlay.sh --python $(PY) --revert; rm -f $(STAMP_OVERLAY); fi
	$(PY) -m scripts.setup.install_deps
	$(PY) -m pip install -q $$($(PY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml','rb'))['project']['optional-dependencies']['dev']))")
	touch $@

$(STAMP_OVERLAY): $(STAMP_DEPS) $(OVERLAY_FILES) scripts/apply_overlay.py
	scripts/apply_overlay.sh --python $(PY) $(OVERLAY_MODE)
	touch $@

$(TRITON_ORACLE)/.stamp: recipe/pins.yaml | $(PY)
	rm -rf $(TRITON_ORACLE) && $(PY) -m pip install -q --no-deps --target $(TRITON_ORACLE) triton==3.9.0
	touch $@

model: setup ## generate the tiny DeepSeek-V4-DSpark checkpoint under models/, train its draft (once)
	@$(VLLM_CPU_ENV) $(PY) -m scripts.tiny.ensure

.PHONY: model-tp4
# Its draft is left as generated (random): the four-node rehearsal checks the launch, the faults
# and losslessness, not acceptance (training it would take ~an hour of this 2-core machine).
model-tp4: setup ## the four-output-group tiny checkpoint the cpu-4x profile serves (TP=4), generated once
	@[ -f $(TINY_TP4_MODEL)/config.json ] || $(PY) -m scripts.tiny.make_tiny_model --dspark --o-groups 4 --out $(TINY_TP4_MODEL)

MEMBOUND_MODEL := models/membound-dsv4-dspark
model-membound: setup ## the memory-bound CPU twin for benchmarks (2.7 GB; once: generation about 6 min on 2 lightly loaded cores, then the target measured and the draft trained); cached
	@$(VLLM_CPU_ENV) $(PY) -m scripts.tiny.membound --out $(MEMBOUND_MODEL)

demo: setup model ## run DSpark in real vLLM on CPU over a mixed batch (the main job)
	$(VLLM_CPU_ENV) VLLM_ENABLE_V1_MULTIPROCESSING=0 $(PY) -m scripts.demo --model $(TINY_MODEL)

serve: setup model ## `vllm serve` with the cpu-tiny profile's arguments (Ctrl-C stops)
	$(VLLM_CPU_ENV) $(PY) -m scripts.serve --profile $(PROFILE)

test: setup model $(TRITON_ORACLE)/.stamp ## set up (tiny checkpoint and its trained draft included), then run the whole test suite (CPU)
	$(VLLM_CPU_ENV) $(PY) -m pytest

test-fast: setup model ## the unit and integration tiers (no engine, no server; tests/README.md)
	$(VLLM_CPU_ENV) $(PY) -m pytest tests/unit tests/integration

upstream-tests: setup ## vLLM's own tests of the files the overlay patches, with and without it (~10 min; not in `make test`)
	$(VLLM_CPU_ENV) $(PY) -m scripts.dev.upstream_tests

mutation: setup ## mutation testing of the core modules (~20 min, not in `make test`): score per module, survivors; MODULES="a b" for some
	$(PY) -m scripts.dev.mutation $(foreach m,$(MODULES),--module $(m))

bench: ## CPU: micro-benchmarks, and the serving sweep if `make serve` runs; Spark head: the sweep inside the container
	@if [ -f $(SPARK_ENV) ]; then \
	  out=/tmp/dspark-bench-$$$$; \
	  $(COMPOSE) exec -T -e BENCH_DIR=$$out vllm /opt/dspark/docker/entrypoint.sh bench $(BENCH_ARGS) && \
	  mkdir -p bench-results && $(COMPOSE) cp vllm:$$out/. bench-results/ && \
	  echo ">> results copied to bench-results/"; \
	else $(MAKE) --no-print-directory bench-cpu; fi

.PHONY: bench-cpu
bench-cpu: setup
	$(PY) -m scripts.bench.ragged
	$(PY) -m scripts.bench.packed_prefill
	@port=$$($(PY) -m scripts.recipe render $(PROFILE) --as env | sed -n 's/^API_PORT=//p'); \
	if curl -sf "http://127.0.0.1:$$port/health" >/dev/null; then \
	  $(VLLM_CPU_ENV) $(PY) -m scripts.bench --profile $(PROFILE) $(BENCH_ARGS); \
	else echo ">> no server on port $$port: skipping the serving sweep (start one with 'make serve')"; fi

ab: setup $(if $(filter cpu-membound,$(PROFILE)),model-membound) ## the serving sweep against two server configurations started one after the other; one ratio table
	$(VLLM_CPU_ENV) $(AB_ENV) $(PY) -m scripts.bench.ab --profile $(PROFILE) $(AB_ARGS) $(BENCH_ARGS)

.PHONY: rebase-check
rebase-check: setup ## VERSION=X: each overlay entry against vLLM X's sources (unchanged / patch applies / fails / now upstream), and whether vllm-cpu X exists
	@[ -n "$(VERSION)" ] || { echo "usage: make rebase-check VERSION=0.33.0" >&2; exit 2; }
	$(PY) -m scripts.rebase_check --version "$(VERSION)"

lint: setup ## ruff, hadolint, shellcheck
	$(PY) -m ruff check scripts tests overlay
	$(VENV)/bin/hadolint docker/Dockerfile
	$(VENV)/bin/shellcheck scripts/preflight.sh scripts/node/head_link.sh scripts/node/selftest_gate.sh scripts/apply_overlay.sh scripts/setup/find_python.sh docker/entrypoint.sh

apply: $(STAMP_DEPS) ## apply the overlay onto the venv's vLLM (linked; OVERLAY_MODE= copies)
	scripts/apply_overlay.sh --python $(PY) $(OVERLAY_MODE) && touch $(STAMP_OVERLAY)

revert: ## take the overlay off the venv's vLLM
	scripts/apply_overlay.sh --python $(PY) --revert && rm -f $(STAMP_OVERLAY)

check: ## report whether the overlay is applied to the venv's vLLM
	scripts/apply_overlay.sh --python $(PY) --check

# The two-Spark launch on this machine: two network namespaces as the two nodes, the real
# docker/entrypoint.sh on each (needs root; README "Two Sparks").
REHEARSE_ARGS ?= --faults
NODES ?= 2
rehearse: setup model $(if $(filter 4,$(NODES)),model-tp4) ## the multi-Spark launch for real on this machine (root; NODES=4: four over a bridge): smoke, audit, load, faults, lossless
	@if [ "$$(id -u)" = 0 ]; then $(PY) -m scripts.rehearse --nodes $(NODES) $(REHEARSE_ARGS); \
	else echo ">> network namespaces need root: running it with sudo"; sudo $(PY) -m scripts.rehearse --nodes $(NODES) $(REHEARSE_ARGS); fi

# ---- Two DGX Sparks (README "Two Sparks"); every target acts on this node ---------------
SPARK_ENV ?= docker/.env
COMPOSE := docker compose -f docker/compose.yaml --env-file $(SPARK_ENV)
DSPARK_IMAGE ?= $(or $(shell sed -n 's/^DSPARK_IMAGE=//p' $(SPARK_ENV) 2>/dev/null),dspark-vllm:local)
OVERLAY_VERSION = $(shell sed -n 's/^overlay_version:[[:space:]]*//p' overlay/manifest.yaml | tr -d "\"' ")

# The Dockerfile's escape hatches: an exact precompiled vLLM wheel (URL or path) for the pinned
# commit instead of the one vLLM looks up; DOWNLOAD_KERNELS=0 skips FlashInfer's prebuilt kernels.
VLLM_PRECOMPILED_WHEEL_LOCATION ?=
DOWNLOAD_KERNELS ?= 1

image: ## build the Spark image on this node (aarch64, CUDA 13, sm_121; pins from recipe/)
	eval "$$($(PYTHON) -m scripts.recipe pins --as env)" && \
	  DOCKER_BUILDKIT=1 docker build -f docker/Dockerfile -t $(DSPARK_IMAGE) \
	    --build-arg BASE_IMAGE="$$BASE_IMAGE" --build-arg BASE_TAG="$$BASE_TAG" \
	    --build-arg VLLM_VERSION="$$VLLM_VERSION" --build-arg VLLM_GIT_TAG="$$VLLM_GIT_TAG" \
	    --build-arg VLLM_GIT_COMMIT="$$VLLM_GIT_COMMIT" --build-arg VLLM_REPO="$$VLLM_REPO" \
	    --build-arg TORCH_CUDA_ARCH_LIST="$$TORCH_CUDA_ARCH_LIST" \
	    --build-arg OVERLAY_VERSION="$(OVERLAY_VERSION)" \
	    --build-arg CONTENT_SHA256="$$($(PYTHON) -m scripts.node.content_hash)" \
	    --build-arg VLLM_PRECOMPILED_WHEEL_LOCATION="$(VLLM_PRECOMPILED_WHEEL_LOCATION)" \
	    --build-arg DOWNLOAD_KERNELS="$(DOWNLOAD_KERNELS)" \
	    --build-arg RECIPE_REVISION="$$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" .

# `make selftest`: with docker/.env (a Spark) in the image on this node's GPU, the record in
# .cache/selftest/ where preflight reads it; else on this CPU in .venv. PAIR=1: TP=2 (CPU: two
# ranks on this machine; across both Sparks not implemented yet).
PAIR ?=
selftest: ## the overlay's DSpark checked on this node's device before `make up` (PAIR=1: TP=2); writes the record preflight reads
	@if [ -f $(SPARK_ENV) ]; then \
	  if [ -n "$(PAIR)" ]; then echo ">> PAIR=1 across two Sparks is not implemented yet: run make selftest on each node" >&2; exit 2; fi; \
	  mkdir -p .cache/selftest && \
	  docker run --rm --gpus all --ipc host --network none -u $$(id -u):$$(id -g) \
	    -e PROFILE="$$(sed -n 's/^PROFILE=//p' $(SPARK_ENV) | tail -n 1)" \
	    -e DSPARK_IMAGE_ID="$$(docker image inspect --format '{{.Id}}' $(DSPARK_IMAGE))" \
	    -v "$(CURDIR)/.cache/selftest:/records" -v dspark_jit-cache:/cache/jit \
	    $(DSPARK_IMAGE) selftest; \
	else $(MAKE) --no-print-directory setup && \
	  $(VLLM_CPU_ENV) VLLM_ENABLE_V1_MULTIPROCESSING=0 $(if $(PAIR),VLLM_CPU_OMP_THREADS_BIND="0|1") \
	    $(PY) -m scripts.selftest $(if $(PAIR),--tp 2); fi

status: ## this node in one screen: container, health, model, runner, last self-test, DSpark counters
	@PROFILE="$$(sed -n 's/^PROFILE=//p' $(SPARK_ENV) 2>/dev/null | tail -n 1)"; \
	  $(PYTHON) -m scripts.node.status --profile "$${PROFILE:-spark-2x}"

up: ## preflight this node, then start its rank (NODE_RANK in docker/.env) in the background
	scripts/preflight.sh --env-file $(SPARK_ENV)
	$(COMPOSE) up -d
	@echo ">> started; 'make logs' to follow, 'make smoke' once the head reports healthy"

down: ## stop and remove this node's container
	$(COMPOSE) down

logs: ## follow this node's vLLM log
	$(COMPOSE) logs -f --tail=200

smoke: ## chat completion + spec-decode counters (+ socket audit): the Spark pair if docker/.env exists, else `make serve`
	@if [ -f $(SPARK_ENV) ]; then $(COMPOSE) exec -T vllm /opt/dspark/docker/entrypoint.sh smoke && \
	  scripts/preflight.sh audit --env-file $(SPARK_ENV); \
	else $(PY) -m scripts.smoke --profile $(PROFILE); fi

.PHONY: monitoring
monitoring: ## head only, optional: Prometheus (scrapes /metrics with the key) and Grafana with the DSpark dashboard, on loopback
	eval "$$($(PYTHON) -m scripts.monitoring images)" && \
	  export PROMETHEUS_IMAGE GRAFANA_IMAGE && $(COMPOSE) --profile monitoring up -d prometheus grafana
	@echo ">> Grafana on http://127.0.0.1:3000 of this node (admin/admin at first login; ssh -L 3000:127.0.0.1:3000 from a laptop)"

audit: ## after start: fail if an inter-node port of this node's vLLM listens beyond the fabric link
	scripts/preflight.sh audit --env-file $(SPARK_ENV)

clean: ## remove the venv, caches and generated models
	rm -rf $(VENV) $(CACHE) models
