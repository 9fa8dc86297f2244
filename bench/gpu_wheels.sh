#!/usr/bin/env bash
# Wheels for bench/gpu_check.py on a GPU machine without network access that has CUDA torch and transformers
# but not the rest of grpo-mega's dependencies: run this where pip reaches PyPI, copy the folder over, then there
#   python3 -m pip install --no-index --no-deps --target /tmp/site WHEEL_DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 bench/gpu_check.py --out gpu_check.json
# Usage: bench/gpu_wheels.sh [WHEEL_DIR (default .whl)] [PYTHON_VERSION of the GPU machine (default 3.12)]
# PIP_PYTHON: the Python whose pip downloads here (default python3; e.g. .venv/bin/python where python3 has no pip)
# megatron-core 0.16.1: the one the H200 run used (pyproject.toml admits up to 0.19; docs/clusters.md, "Versions").
# omegaconf needs antlr4-python3-runtime 4.9.x (latex2sympy2_extended, math-verify's pin, takes 4.9.3 too), which PyPI
# has as a source archive only, so it is built into a wheel here (pure Python).
# Never vLLM (nor torch or transformers): each vLLM release pins its torch exactly (the gpu extra's 0.33.0: torch
# 2.14.0; 0.32.0: 2.13.0), which would replace the machine's CUDA torch, and its wheels are too large to carry. The
# check runs on the machine's own torch and transformers, its vllm stages not run ("vLLM is not installed").
set -euo pipefail
out=${1:-.whl}
py=${2:-3.12}
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform any)
"${PIP_PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" -d "$out" megatron-core==0.16.1 omegaconf==2.3.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0
sdist=$(mktemp -d)
"${PIP_PYTHON:-python3}" -m pip download --quiet --no-deps --no-binary=:all: -d "$sdist" antlr4-python3-runtime==4.9.3
"${PIP_PYTHON:-python3}" -m pip wheel --quiet --no-deps -w "$out" "$sdist"/antlr4*
rm -rf "$sdist"
ls "$out"
