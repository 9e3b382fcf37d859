# kvresearch: every user-facing action is one target here. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
CONSTRAINTS ?= -c requirements/lock.txt
PY := $(VENV)/bin/python
KVZAP_THRESHOLDS ?= -4.5,-3.5,-2.5
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export HF_HUB_DISABLE_PROGRESS_BARS := 1
export TRANSFORMERS_VERBOSITY := error
export TOKENIZERS_PARALLELISM := false

.PHONY: help install surrogate-study surrogate-recipe surrogate-curve surrogate-probe surrogate-transfer lock lint format test test-fast reproduce needle extract bench-extract bench-kvzap bench-am bench-windows bench-presses compat device-wheels device-check sizing budgets train-surrogate evaluate sweep-ruler sweep-longctx sweep-am aime fidelity lm-eval tables clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_%-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'
	@echo "  experiments (make experiment-<name>, make table-<name>):" $(EXPERIMENTS)

install: $(STAMP) ## venv with torch (override: TORCH=...), the project, dev tools and the offline data packages

$(STAMP): pyproject.toml requirements/lock.txt requirements/nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q $(CONSTRAINTS) -e ".[dev]"
	$(PIP) install -q --no-deps -r requirements/nodeps.txt
	touch $(STAMP)

lock: $(STAMP) ## rewrite requirements/lock.txt from the current venv
	$(PIP) freeze --exclude-editable | grep -viE '^(torch|kvresearch)==' \
	  | grep -viFf <(sed -e '/^#/d' -e 's/==.*//' requirements/nodeps.txt) > requirements/lock.txt.new
	mv requirements/lock.txt.new requirements/lock.txt

lint: $(STAMP) ## ruff lint + format check, mypy on the package and the scripts
	$(VENV)/bin/ruff check kvresearch tests scripts
	$(VENV)/bin/ruff format --check kvresearch tests scripts
	$(VENV)/bin/mypy

format: $(STAMP) ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix kvresearch tests scripts
	$(VENV)/bin/ruff format kvresearch tests scripts

test: $(STAMP) lint ## lint, then the whole test suite on CPU (GPU tests skip without a GPU)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP) ## the suite without the slow (embedded-model, end-to-end) tests
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

needle: $(STAMP) ## full-cache needle retrieval on the embedded model (outputs/needle/)
	$(PY) -m kvresearch.stages.needle $(ARGS)

extract: $(STAMP) ## KVzip+ oracle scores -> training shards (outputs/extract/default/, ~13 min on 2 cores)
	$(PY) -m kvresearch.stages.extract $(ARGS)

# The surrogate study's choice (docs/surrogates.md): the context-aware MLP on every position of 249 documents
# (the study's extract, run id 3ab4656e; paths.surrogate_mlp_context names the run it gives). CONTEXT=0 skips it.
CONTEXT ?= 1
CONTEXT_EXTRACT := corpus.n_train_per_source=75

train-surrogate: $(STAMP) ## the default extract (skipped when done), linear + MLP surrogates on it; the context-aware MLP on the study's extract (CONTEXT=0: not); the fit table
	$(PY) -m kvresearch.stages.extract
	$(PY) -m kvresearch.stages.train_surrogate -m surrogate=linear,mlp $(ARGS)
	if [ "$(CONTEXT)" != 0 ]; then \
	  $(PY) -m kvresearch.stages.extract $(CONTEXT_EXTRACT) && \
	  $(PY) -m kvresearch.stages.train_surrogate surrogate=mlp_context paths.extract=3ab4656e $(ARGS); fi
	$(PY) scripts/surrogate_table.py --per-layer

surrogate-study: $(STAMP) ## leave-one-source-out R^2, learning curve, mix and width on the study's extract (docs/surrogates.md, ~45 min + its extract)
	$(PY) scripts/surrogate_study.py $(ARGS)

surrogate-recipe: $(STAMP) ## the MLP's optimisation with essays left out: epochs, lr, weight decay, a second seed (~30 min)
	$(PY) scripts/surrogate_study.py --parts recipe --name surrogate_recipe $(ARGS)

# Every document the packaged corpora give (2,114), for the learning curve up to all of them: extracted in
# CURVE_PARTS resumable parts (a finished part is skipped), merged into the run folder the curve reads.
CURVE_PARTS := 6
comma := ,
EXTRACT_ALL := corpus.n_test_per_source=null corpus.n_train_per_source=null extract.num_shards=$(CURVE_PARTS) extract.samples_per_doc=500
# Its run folder is Hydra's name for those overrides: comma-joined, keys sorted (as written above).
empty :=
EXTRACT_ALL_RUN := extract/$(subst $(empty) $(empty),$(comma),$(EXTRACT_ALL))

surrogate-curve: $(STAMP) ## the learning curve up to every packaged document: extract all 2,114 in 6 resumable parts (~41 min each, 37 GB in all), fit each point (~1 h 40 min; ARGS=--finished-only tabulates what is finished)
	$(PY) -m kvresearch.stages.extract -m $(EXTRACT_ALL) 'extract.shard_index=range(0,$(CURVE_PARTS))'
	$(PY) -m kvresearch.stages.extract $(EXTRACT_ALL)
	$(PY) scripts/surrogate_study.py --extract $(EXTRACT_ALL_RUN) --parts curve --name surrogate_curve_all $(ARGS)

surrogate-probe: $(STAMP) ## what the surrogate's input lacks: ridge on h plus value norms / position, essays left out (~8 min; ARGS: --fit mlp, --inputs counts)
	$(PY) scripts/surrogate_probe.py $(ARGS)

surrogate-transfer: $(STAMP) ## after train-surrogate: its surrogates on sources none trains on (news, science, fiction; ~9 min extract + 1 min)
	$(PY) -m kvresearch.stages.extract corpus=benchmark_prose
	$(PY) scripts/surrogate_transfer.py $(ARGS)

evaluate: $(STAMP) ## one evaluate run: make evaluate ARGS="method=kvzap_mlp method.threshold=-4"
	$(PY) -m kvresearch.stages.evaluate $(ARGS)

# The first result's subset (fits the 60-minute reproduce on 2 cores): the four niah tasks the 135M model can
# do at 2k (it scores 0 on vt, cwe and fwe with the full cache), 4 samples each.
RULER_SMALL := benchmark.lengths=[2048] benchmark.samples_per_task=4 evaluate.max_new_tokens=48 \
  benchmark.tasks=[niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue]
EVAL := $(PY) -m kvresearch.stages.evaluate -m $(RULER_SMALL)

sweep-ruler: $(STAMP) ## the first result: RULER 2k on the embedded model, KVzap vs KVzip+ vs kvpress presses
	$(EVAL) method=full
	$(EVAL) method=kvzap_mlp,kvzap_linear method.threshold=$(KVZAP_THRESHOLDS)
	$(EVAL) method=kvzip_plus method.keep_ratio=0.33
	$(EVAL) method=snapkv,streaming_llm method.keep_ratio=0.5,0.33

# Long-context benchmarks on the embedded model (docs/evaluation.md): the vendored LongBench tasks, the LongBench
# v2 subset and QuALITY, prompts cut in the middle to LONG_BUDGET tokens, a few contexts each; the full cache, then
# every method at about 2x and 4x. ~2.5 h on 2 CPU cores; on a GPU set LONG_BUDGET=null and raise the counts.
LONG_BUDGET ?= 2048
LONG_METHODS ?= kvzap_mlp,kvzap_linear,kvzip_plus,snapkv,streaming_llm,am_highest
LONG_SHARED := evaluate.max_new_tokens=64 benchmark.max_prompt_tokens=$(LONG_BUDGET)
LONG_BENCHMARKS := "benchmark=longbench benchmark.samples_per_task=3" \
  "benchmark=longbench_v2 benchmark.samples_per_task=6" \
  "benchmark=quality benchmark.max_documents=2 benchmark.truncate=middle"

sweep-longctx: $(STAMP) ## LongBench, LongBench v2 and QuALITY subsets on the embedded model: full cache, then each method at 2x and 4x
	for b in $(LONG_BENCHMARKS); do \
	  $(PY) -m kvresearch.stages.evaluate -m $(LONG_SHARED) $$b method=full && \
	  $(PY) -m kvresearch.stages.evaluate -m $(LONG_SHARED) $$b method=$(LONG_METHODS) method.keep_ratio=0.5,0.25 \
	  || exit 1; done

# Attention Matching against eviction at high ratios (docs/attention_matching.md): log-perplexity of the full-context
# answers and agreement with them at 3x, 10x, 20x and 50x on the QuALITY subset of sweep-longctx (the same full-cache
# run) and on RULER 2k. CPU key points: AM_RATIOS=0.1,0.02 (10x and 50x); the default grid is the whole curve.
AM_RATIOS ?= 0.33,0.1,0.05,0.02
AM_UNIFORM := am_highest,am_omp,am_omp_fast,am_highest_onpolicy,am_omp_onpolicy,am_kvzip_keys,summarize_am
AM_BUDGETED := am_highest_budgets,am_omp_budgets,am_highest_global_layer,am_omp_global_layer,am_highest_global_model,am_omp_global_model
AM_ONLY ?= $(AM_UNIFORM),$(AM_BUDGETED)
AM_METHODS ?= $(AM_ONLY),summarize,kvzip_plus,kvzap_mlp,snapkv,streaming_llm
AM_RULER := benchmark=ruler benchmark.lengths=[2048] benchmark.samples_per_task=2 evaluate.max_new_tokens=48 \
  benchmark.tasks=[niah_single_2,niah_multikey_1]
AM_BENCHMARKS := "$(LONG_SHARED) benchmark=quality benchmark.max_documents=2 benchmark.truncate=middle" "$(AM_RULER)"

sweep-am: $(STAMP) ## AM (self-study, budgets, on-policy), the hybrid, summarization and eviction at 3x-50x: QuALITY, RULER 2k
	for b in $(AM_BENCHMARKS); do \
	  $(PY) -m kvresearch.stages.evaluate -m $$b method=full && \
	  $(PY) -m kvresearch.stages.evaluate -m $$b method=$(AM_METHODS) method.keep_ratio=$(AM_RATIOS) \
	  || exit 1; done
	$(PY) scripts/am_curves.py --benchmark quality --match "benchmark.max_documents=2,"
	$(PY) scripts/am_curves.py --benchmark ruler --match "benchmark.tasks=[niah_single_2,niah_multikey_1]"

# Compression while generating. CPU-sized: AIME_TOKENS=32000 AIME_PROBLEMS=30 and GEN_TOKENS=1024 GEN_PROMPTS=20
# are the full settings (a GPU). GEN_BUDGETS: per-head cache sizes the presses and Attention Matching decode under;
# they compress only while decoding (the prompt is kept whole: keep_ratio null, or 1 for AM), as in the AM paper.
AIME_TOKENS ?= 512
AIME_PROBLEMS ?= 10
AIME_SHARED = benchmark=aime25 evaluate.max_new_tokens=$(AIME_TOKENS) evaluate.max_samples=$(AIME_PROBLEMS)
GEN_TOKENS ?= 512
GEN_PROMPTS ?= 8
GEN_BUDGETS ?= 128,256
GEN_SHARED = fidelity.new_tokens=$(GEN_TOKENS) fidelity.prompts=$(GEN_PROMPTS)

aime: $(STAMP) ## AIME25 on the embedded model (sampled as the paper): full cache, then KVzap-MLP pruning while decoding
	$(PY) -m kvresearch.stages.evaluate $(AIME_SHARED) method=full
	$(PY) -m kvresearch.stages.evaluate $(AIME_SHARED) method=kvzap_mlp method.decoding=true

fidelity: $(STAMP) ## long greedy generations vs the full cache's: KVzap, presses and AM re-compression while decoding
	$(PY) -m kvresearch.stages.fidelity $(GEN_SHARED) method=full
	$(PY) -m kvresearch.stages.fidelity -m $(GEN_SHARED) method=kvzap_mlp,kvzap_linear ++method.decoding=true ++method.threshold=-5,-3
	$(PY) -m kvresearch.stages.fidelity -m $(GEN_SHARED) method=streaming_llm ++method.keep_ratio=null \
	  '++method.decoding={interval:64}' ++method.decoding.target_size=$(GEN_BUDGETS)
	$(PY) -m kvresearch.stages.fidelity -m $(GEN_SHARED) method=snapkv ++method.keep_ratio=null \
	  ++method.press.window_size=32 '++method.decoding={interval:64}' ++method.decoding.target_size=$(GEN_BUDGETS)
	$(PY) -m kvresearch.stages.fidelity -m $(GEN_SHARED) method=am_highest ++method.keep_ratio=1.0 \
	  '++method.decoding={interval:128,protect:32}' ++method.decoding.target_size=$(GEN_BUDGETS)

LMEVAL_LIMIT ?= 8
lm-eval: $(STAMP) ## lm-eval on the offline tasks (QuALITY by log-likelihood, LongBench qasper by generation): full vs KVzap-MLP
	$(PY) -m kvresearch.stages.lm_eval -m lm_eval.tasks=[kvr_quality,kvr_longbench_qasper] lm_eval.limit=$(LMEVAL_LIMIT) \
	  lm_eval.max_length=$(LONG_BUDGET) method=full,kvzap_mlp

# The papers' tables and figures (conf/experiment/<name>.yaml, docs/results/experiments/): each experiment has a
# `twin` variant (embedded model, offline data, 2 CPU cores) and a `hub` variant (the paper's models and grid, for
# a GPU cluster: VARIANT=hub, EXP_ARGS="--launcher slurm" or "--print" for the commands).
VARIANT ?= twin
EXP_ARGS ?=
EXPERIMENTS := $(basename $(notdir $(wildcard conf/experiment/*.yaml)))

experiment-%: $(STAMP) ## run the missing cells of conf/experiment/<name>.yaml (VARIANT=twin|hub), e.g. make experiment-kvzap_ruler
	$(PY) scripts/experiment.py run $* --variant $(VARIANT) $(EXP_ARGS)

table-%: $(STAMP) ## rebuild an experiment's table (.md, .tex) and figure (.png, .pdf) from run folders and run records (docs/results/runs/); unfinished cells print "not run"
	$(PY) scripts/experiment.py table $* --variant $(VARIANT)

tables: $(STAMP) ## every evaluate run -> docs/results/<benchmark>_table.md and <benchmark>_curve.png
	$(PY) scripts/make_tables.py --out docs/results

bench-extract: $(STAMP) ## extraction speed and memory vs the eager reference (outputs/bench/extract.json)
	$(PY) scripts/bench_extract.py

bench-kvzap: $(STAMP) ## KVzap vs full cache vs kvpress: overhead, KV bytes, decode speed (outputs/bench/kvzap.json)
	$(PY) scripts/bench_kvzap.py $(ARGS)

bench-am: $(STAMP) ## Attention Matching solvers vs top-attention keys: time per head, held-out errors, 10x answers (outputs/bench/am.json)
	$(PY) scripts/bench_am.py $(ARGS)

bench-windows: $(STAMP) ## Gemma-3-270m's sliding layers: KV bytes before/after the out-of-window drop vs transformers' cache (outputs/bench/windows.json)
	$(PY) scripts/bench_windows.py $(ARGS)

bench-presses: $(STAMP) ## kvpress presses with real eviction vs kvpress's own prefill; kept-key position lookup (outputs/bench/presses.json)
	$(PY) scripts/bench_presses.py $(ARGS)

compat: $(STAMP) ## the GPU image's versions (Python 3.12, torch 2.11, transformers 5.17) in .venv-compat: the device check from the carried wheels, then the tests marked compat
	scripts/compat.sh

device-wheels: $(STAMP) ## wheels of what the GPU image lacks (requirements/device.txt) into .device-wheels/ with a manifest (< 30 MB)
	$(PY) -m kvresearch.device_wheels

PLAN ?= tiny
OUT ?= outputs/device_check
device-check: ## the prepared device check (docs/gpu.md): PLAN=gpu on a GPU (Qwen3-8B shape, bf16), PLAN=tiny on a CPU; JSON + summary in OUT
	$(if $(wildcard $(PY)),$(PY),python3) -m kvresearch.device_check --out $(OUT) --plan $(PLAN)

sizing: $(STAMP) ## GPU-hours of every experiment's hub variant -> docs/results/sizing.md (measured rates from docs/results/gpu/ where they exist)
	$(PY) -m kvresearch.sizing

budgets: $(STAMP) ## per-head AM budgets by measured sensitivity -> budgets.json (method.budgets=<that file>)
	$(PY) -m kvresearch.stages.budgets $(ARGS)

reproduce: $(STAMP) ## the main job on the embedded model: extract, surrogates, the RULER experiment's twin, its tables
	$(MAKE) --no-print-directory train-surrogate CONTEXT=0
	$(MAKE) --no-print-directory experiment-kvzap_ruler table-kvzap_ruler table-kvzap_surrogate_r2

clean: ## remove caches (keeps outputs/ and the venv)
	rm -rf .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
