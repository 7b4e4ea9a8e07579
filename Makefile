# Two entry points: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/nonstop demo

test: $(STAMP)
	$(VENV)/bin/ruff check nonstop tests bench
	$(PY) -m pytest -q -x --timeout=900 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check nonstop tests bench
	$(VENV)/bin/ruff format --check nonstop tests bench

clean:
	rm -rf $(VENV) .pytest_cache
