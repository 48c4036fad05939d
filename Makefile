# bitquilt — two commands on a fresh machine: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BQ := $(VENV)/bin/bitquilt
STAMP := $(VENV)/.installed

.PHONY: setup assets kernels demo test test-all lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP) kernels

# the CPU kernels are optional: a failed build leaves the torch reference path (one warning line)
kernels: $(STAMP)
	-@$(PY) -m bitquilt.kernels.cpu 2>/dev/null || echo "bitquilt: CPU kernels not built; using the torch reference path"

assets: $(STAMP)
	$(BQ) fetch smollm2-135m
	$(BQ) fetch eval-data

demo: setup assets
	$(BQ) compare smollm2-135m --methods fp,rtn,gptq --w-bits 4,3 --group-size 128 \
		--calib-samples 16 --calib-seqlen 512 --seqlen 512 --ppl-windows 8

test: setup assets
	$(PY) -m pytest -q

test-all: setup assets
	$(PY) -m pytest -q -m ""

lint: $(STAMP)
	$(VENV)/bin/ruff check bitquilt tests bench

bench: setup assets
	$(PY) bench/accuracy.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
