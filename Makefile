# The two commands a user needs: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
DATA_DIR ?= ./data

.PHONY: setup run test lint soak fuzz bench clean etcd

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,spark,etcd]'
	$(MAKE) --no-print-directory etcd
	touch $(STAMP)

# etcd for replicated broker groups with automatic election (docs/cluster.md) and their tests:
# Debian's etcd-server package (the binary /usr/bin/etcd; tests and `tidemq cluster up
# --election` run their own etcd processes, never the package's service). Without apt (or
# root) setup goes on and the election tests skip, saying why.
etcd:
	@if command -v etcd >/dev/null 2>&1 || test -x /usr/bin/etcd; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "warning: etcd is not installed and there is no apt-get: election tests will skip"; \
	else \
	  SUDO=; if [ "$$(id -u)" != 0 ]; then SUDO="sudo -n"; fi; \
	  echo "installing etcd (Debian package etcd-server)"; \
	  ( $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server >/dev/null \
	    || ( $$SUDO apt-get update -q >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive \
	         apt-get install -y -q --no-install-recommends etcd-server >/dev/null ) ) \
	  || echo "warning: installing etcd-server failed: election tests will skip"; \
	fi

run: setup
	$(BIN)/python examples/run_pipeline.py --data-dir $(DATA_DIR)

lint: setup
	$(BIN)/ruff check src tests examples
	$(BIN)/lint-imports
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q tests

soak: setup
	TIDEMQ_SOAK=1 $(BIN)/python -m pytest -q tests -m slow

# The fuzz suite (tests/fuzz) with many more generated frames and batches than `make test`
# runs (FUZZ_EXAMPLES per test; about 25 minutes at the default).
FUZZ_EXAMPLES ?= 20000
fuzz: setup
	TIDEMQ_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q tests/fuzz

clean:
	rm -rf $(VENV) $(DATA_DIR) build src/*.egg-info
