# Two set-up commands: `make demo` and `make test`. Both create .venv and install into it.
# torch is pinned to the exact CPU wheel on this machine's disk and installed first, so that
# no extra or dependency can pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast lint bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[train,dev,cluster,titan]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m sparsebalance.demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not slow" -p no:cacheprovider

# On a CUDA machine (a lent one too: no .venv, no network, its own python3, torch and triton):
# kernel accuracy (compiled) and speed, stage validation, CUDA profiles, GPU tests; flat results in
# $$OUT (default results/gpu-check) with summary.md, 8 minutes at most. Exits 2 without CUDA.
gpu-check:
	bash scripts/gpu-check.sh

# ruff on the code, mypy on the typed core (its files and settings: [tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check sparsebalance tests benchmarks
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/bench_simulator.py
	$(PY) benchmarks/bench_policies.py

clean:
	rm -rf $(VENV) results *.egg-info
