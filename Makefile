# The two commands a user needs: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
DATA_DIR ?= ./data

.PHONY: setup run test lint soak bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,spark]'
	touch $(STAMP)

run: setup
	$(BIN)/python examples/run_pipeline.py --data-dir $(DATA_DIR)

lint: setup
	$(BIN)/ruff check src tests examples
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q tests

soak: setup
	TIDEMQ_SOAK=1 $(BIN)/python -m pytest -q tests -m slow

clean:
	rm -rf $(VENV) $(DATA_DIR) build src/*.egg-info
