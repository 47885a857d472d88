# perfmon: `make demo` runs the embedded demo, `make test` runs every test.
# Both create .venv when missing and install torch first from $(TORCH) (a CPU build by default),
# so the package's own `torch>=...` requirement never pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.perfmon-installed

.PHONY: demo test lint bench tools clean gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: $(STAMP)
	$(BIN)/perfmon demo $(DEMO_ARGS)

# The tests need promtool and prometheus (Debian's prometheus package) and, for the status page, a
# headless browser (Debian's chromium and chromium-driver). Install them when we can; say what will be
# skipped when we cannot.
TOOLS_PKGS := prometheus chromium chromium-driver
tools:
	@missing=""; \
	command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	if [ -z "$$missing" ]; then \
		echo "tools: prometheus, promtool, chromium and chromedriver found"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "tools: installing Debian packages:$$missing"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
			|| echo "tools: could not install$$missing; tests needing them will be SKIPPED (see pytest's summary)"; \
	else \
		echo "tools: missing$$missing and apt-get unavailable (not root?); tests needing them will be SKIPPED"; \
	fi

test: $(STAMP) tools
	$(BIN)/ruff check perfmon tests benchmarks grafana examples
	$(BIN)/mypy
	$(BIN)/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check perfmon tests benchmarks grafana examples
	$(BIN)/mypy

# Every benchmark (about 10 minutes); tables to the terminal, JSON to benchmarks/results, plots to docs/.
bench: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	mkdir -p benchmarks/results
	cd benchmarks && ../$(BIN)/python overhead.py --json results/overhead.json
	cd benchmarks && ../$(BIN)/python accuracy.py --json results/accuracy.json
	cd benchmarks && ../$(BIN)/python gil_order.py --json results/gil_order.json
	cd benchmarks && ../$(BIN)/python detection.py --json results/detection.json
	cd benchmarks && ../$(BIN)/python scrape.py --json results/scrape.json
	cd benchmarks && ../$(BIN)/python background.py --json results/background.json
	cd benchmarks && ../$(BIN)/python agent_cost.py --json results/agent_cost.json
	cd benchmarks && ../$(BIN)/python nvml_cost.py --json results/nvml_cost.json
	cd benchmarks && ../$(BIN)/python generate_where.py --json results/generate_where.json
	cd benchmarks && ../$(BIN)/python generate_solo.py --json results/generate_solo.json
	cd benchmarks && ../$(BIN)/python instructions.py --json results/instructions.json
	cd benchmarks && ../$(BIN)/python generation_cost.py
	cd benchmarks && ../$(BIN)/python gc_cost.py --json results/gc_cost.json
	cd benchmarks && ../$(BIN)/python flop_count.py --json results/flop_count.json
	cd benchmarks && ../$(BIN)/python mix_shift.py --runs 5 --json results/mix_shift.json
	cd benchmarks && ../$(BIN)/python throughput.py --json results/throughput.json
	cd benchmarks && ../$(BIN)/python memory.py --json results/memory.json
	cd benchmarks && ../$(BIN)/python hostile.py
	cd benchmarks && ../$(BIN)/python soak.py --seconds 60 --json results/soak.json
	$(BIN)/python benchmarks/plots.py benchmarks/results docs

# On a CUDA machine: the GPU tests, then a measured report ($(GPU_CHECK_OUT)/gpucheck.md and .json, one
# verdict per check; exit 1 if a check failed, 3 without CUDA). GPU_CHECK_ARGS=--quick for ~1 minute.
# The report is benchmarks/gpucheck/ (a developer's harness, not in the wheel), run from this directory.
# With no .venv and a system python3 that already has torch (a lent GPU machine: no network, so no venv
# can be built), it runs that Python on this tree, with wheels carried in .whl/ (structlog, pytest-timeout)
# installed into a temporary directory first: README.md, "Real GPU check". Without pytest-timeout there,
# the tests run without pyproject's per-test timeout (--strict-config would refuse its unknown setting).
GPU_CHECK_ARGS ?=
GPU_CHECK_OUT ?= gpucheck-report
GPU_SITE ?= $${TMPDIR:-/tmp}/perfmon-gpucheck-site
# The report runs even when a GPU test fails (a lent machine is brief); the target fails if either did.
gpu-check:
	@if [ ! -x $(BIN)/python ] && $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "gpu-check: no $(VENV); using $(PYTHON) ($$($(PYTHON) -c 'import torch; print(torch.__version__)'))"; \
	  if ls .whl/*.whl >/dev/null 2>&1; then \
	    $(PYTHON) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) .whl/*.whl || exit 2; fi; \
	  export PYTHONPATH="$(CURDIR):$(GPU_SITE)"; py=$(PYTHON); \
	  $$py -c "import pytest_timeout" 2>/dev/null || { notimeout="-o addopts=-ra -W ignore::pytest.PytestConfigWarning"; \
	    echo "gpu-check: no pytest-timeout (carry its wheel in .whl/): the GPU tests run without a per-test timeout"; }; \
	else $(MAKE) --no-print-directory $(STAMP) || exit 2; py=$(BIN)/python; fi; \
	$$py -m pytest tests/gpu -q -p no:cacheprovider $$notimeout; tests=$$?; \
	$$py -m benchmarks.gpucheck --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS); report=$$?; \
	[ $$tests -eq 0 ] || exit $$tests; exit $$report

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
