# Two commands for a fresh machine: `make demo` (the CPU quickstart) and `make test` (the test suite).
# Both create the virtual environment on first use. On CPU machines torch is pinned to the CPU build
# torch==2.13.0 before the package is installed; on GPU clusters set TORCH= (empty) to keep your own torch.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.grpo-mega-installed

.PHONY: demo test install clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH)" ]; then $(PY) -m pip install --quiet "$(TORCH)"; fi
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/grpo-mega quickstart

test: $(STAMP)
	$(PY) -m pytest -q

clean-venv:
	rm -rf $(VENV)
