# Two entry points, each self-installing on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt

.PHONY: demo toys mini mini-objectives test docs fuzz lint bench bench-gpu gpu-wheels mtl clean

$(STAMP): pyproject.toml diffusion/pyproject.toml $(CONSTRAINTS)
	# Debian's Tesseract for the OCR reward (skipped when already on PATH).
	command -v tesseract >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq tesseract-ocr >/dev/null; }
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0 -c $(CONSTRAINTS)
	# The two distributions of this repository: the core (torch + numpy) and the diffusion RL.
	$(PY) -m pip install --quiet -e ".[solvers,plot,dev,bench,mtl,docs]" -e "./diffusion[wandb,mlflow,serve]" \
		-c $(CONSTRAINTS)
	# LibMTL for the parity tests and the head-to-head; --no-deps: its release pins
	# torchvision, which neither needs (its weighting package is loaded on its own).
	$(PY) -m pip install --quiet --no-deps LibMTL==1.1.5 -c $(CONSTRAINTS)
	touch $(STAMP)

# The main job: MARBLE in miniature, quick mode (base vs weighted sum vs MARBLE).
demo: $(STAMP)
	$(PY) -m benchmarks.mini.benchmark --mode quick --out results/mini_quick

# Every harmonizer on the toy problems.
toys: $(STAMP)
	$(PY) -m benchmarks.toys.demo --out results/demo

# The whole miniature head-to-head (every method, 3 seeds, ablations and objective rows on 2):
# ~590 core-seconds per epoch of budget, ~3.5 h on 2 cores at today's 40 epochs.
# `make mini RESUME=1` keeps finished runs of an interrupted one and does the rest.
mini: $(STAMP)
	$(PY) -m benchmarks.mini.benchmark --mode full --out benchmarks/results/mini --work results/mini_work $(if $(RESUME),--resume)

# Flow-GRPO and SDPO under weighted sum and MARBLE (2 seeds), beside NFT's rows of `make mini`
# (reused from its work folder, so run it after `make mini`).
mini-objectives: $(STAMP)
	$(PY) -m benchmarks.mini.benchmark --mode objectives --out benchmarks/results/mini_objectives --work results/mini_work --resume

# ruff, the documentation site with --strict (a broken link or API reference fails here, built
# into a temporary folder), then the whole test suite.
test: $(STAMP)
	$(PY) -m ruff check .
	tmp=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir "$$tmp"; \
		status=$$?; rm -rf "$$tmp"; exit $$status
	$(PY) -m pytest

# The documentation site (mkdocs-material, API reference from the docstrings) -> site/.
# `$(VENV)/bin/mkdocs serve` previews it while you edit docs/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The property tests with fresh randomness and many examples (FUZZ_EXAMPLES per test,
# default 4000: ~20k in all). `make test` replays a fixed, derandomized set instead.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -m hypothesis tests

lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/bench_mgda_exactness.py
	$(PY) benchmarks/bench_gradient_engines.py
	$(PY) benchmarks/bench_instance_gram.py
	# MARBLE's cost against the weighted sum with each gradient engine (~20 min, one thread)
	$(PY) benchmarks/bench_engine_cost.py

# SD3.5-M-shaped training on one GPU (H100/H200): rollout, training, MFU, MARBLE's overhead.
# Writes benchmarks/results/gpu/gpu_<device>.{json,md}; on a CPU it is a smoke run only.
bench-gpu: $(STAMP)
	$(PY) benchmarks/bench_gpu.py --shape sd35m

# Before a GPU lease (docs/benchmarks/gpu.md): the wheels benchmarks/gpu_lease.sh installs on
# the lent machine, which has no network, for its Python 3.12 on x86-64. Its image has torch,
# transformers, peft, accelerate, safetensors and tokenizers but not diffusers: diffusers at
# the pinned version (pure Python). Then checks that what a device call carries (tracked and
# untracked files plus .whl) fits the lease's 64 MiB. Needs only the package registry.
GPU_WHEELS := diffusers
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) -c $(CONSTRAINTS) \
		-d .whl $(GPU_WHEELS)
	ls -l .whl
	$(PYTHON) benchmarks/gpu_lease.py size --carry .whl

# Multi-task head-to-head vs TorchJD and LibMTL on scikit-learn's digits (5 seeds; ~50 min on
# a shared 2-core machine).
mtl: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.mtl.run

clean:
	rm -rf $(VENV) results site
