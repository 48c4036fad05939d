# bitquilt — two commands on a fresh machine: `make demo`, `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BQ := $(VENV)/bin/bitquilt
STAMP := $(VENV)/.installed

.PHONY: setup assets kernels demo test test-all lint bench clean

# torch first, then the package without build isolation, so that its install builds the C++ (setup.py,
# bitquilt/native_build.py) torch extension included, against this torch
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=68" wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e ".[full,dev,serve]"
	touch $(STAMP)

setup: $(STAMP) kernels

# rebuilds what is older than its sources in csrc/ (nothing when none is); a failed build does not stop make: the
# torch reference path runs, and bitquilt-run / bitquilt-native say what is missing
kernels: $(STAMP)
	-$(PY) -m bitquilt.native_build

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
	rm -rf $(VENV) build *.egg-info .pytest_cache bitquilt/_native
