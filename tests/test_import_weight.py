"""What each entry path imports (issue 40): a heavy package a path does not need costs every process that takes it
seconds of start-up (the suite starts hundreds). Each case imports its modules in a fresh interpreter and lists the
packages that must not be loaded; a module-level import that brings one back fails here.

Not checkable here: megatron-core's own ``__init__`` loads torch._dynamo (its fused kernels are decorated with
torch.compile at import), wandb when installed and torch.utils.tensorboard for every rank; see bench/startup.py."""

import json
import subprocess
import sys

import pytest

CASES = {
    # `grpo-mega train|sft|prm ... --nproc N` before it becomes torchrun, and `grpo-mega --help`
    "the command line before the relaunch": (["grpo_mega.cli", "prm.cli"],
                                             ["torch", "transformers", "megatron", "numpy", "yaml"]),
    # a training rank (GRPO, SFT, PRM) with the Megatron engine and HF rollouts: vLLM, DeepSpeed and plotting load
    # only when the config asks for them
    "a training rank": (["grpo_mega.trainer", "grpo_mega.sft", "prm.train", "grpo_mega.rollout",
                         "grpo_mega.engine", "grpo_mega.metrics"],
                        ["vllm", "deepspeed", "matplotlib", "trl", "pandas", "sklearn"]),
}


@pytest.mark.parametrize("case", CASES)
def test_an_entry_path_does_not_load_what_it_does_not_need(case):
    modules, absent = CASES[case]
    probe = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))")
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert not loaded & set(absent), f"{case} loads {sorted(loaded & set(absent))}"
