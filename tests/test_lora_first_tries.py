"""LoRA as a new user first tries it (issue 78, first hour): a resume with other adapters than the checkpoint's is
refused before launch in one line naming the key, whatever allowances the resume gives (the checkpoint's adapters
load into adapters of their own shape only; they failed in the rank after start-up, cause=error, which a SLURM
requeue retries); LoRA on DeepSpeed with a peft that does not import fails naming the key (cause=config), not as a
bare ImportError from inside the engine."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import yaml

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
from grpo_mega.config.checks import check_lora_imports
from grpo_mega.config.lora import LoRAConfig
from grpo_mega.run.checkpoints import FORMAT_NAME, FORMAT_VERSION
from grpo_mega.run.folder import RunFolderError, check_run_folder
from grpo_mega.run.layout import CHECKPOINTS_DIR, COMPLETE_FILE, CONFIG_FILE
from test_first_hour_fast_checks import GRPO, files, refused  # noqa: F401 (the module fixture)


def _config(files, run_dir, *extra: str) -> dict:
    cfg = load_config(GRPOConfig, GRPO, [f"model.hf_config={files['policy']}", f"model.init_from={files['policy']}",
                                         f"data.train_file={files['prompts']}", f"trainer.run_dir={run_dir}",
                                         "engine=deepspeed", "parallel.tensor=1", *extra], validate)
    return asdict(cfg)


def _saved_run(run_dir, config: dict) -> None:
    """A run folder whose one complete checkpoint (step 2) was saved with ``config`` (what the guard reads)."""
    checkpoint = run_dir / CHECKPOINTS_DIR / "step_000002"
    checkpoint.mkdir(parents=True)
    text = yaml.safe_dump(config, sort_keys=False)
    (checkpoint / CONFIG_FILE).write_text(text)
    (checkpoint / COMPLETE_FILE).write_text(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": 2,
                                                        "files": {CONFIG_FILE: len(text.encode())}}))
    (run_dir / CONFIG_FILE).write_text(text)


@pytest.mark.parametrize("rank, targets, shown", [
    ("8", None, "model.lora.rank: 4 -> 8"),
    ("0", None, "model.lora.rank: 4 -> 0"),
    ("4", "[linear_qkv]", "model.lora.target_modules: ['linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2'] -> "),
])
def test_a_resume_with_other_adapters_is_refused_whatever_it_allows(files, tmp_path, rank, targets, shown):
    run_dir = tmp_path / "run"
    _saved_run(run_dir, _config(files, run_dir, "model.lora.rank=4"))
    extra = [f"model.lora.rank={rank}", *([f"model.lora.target_modules={targets}"] if targets else [])]
    for allowance in ("trainer.resume_with_changes=true", "trainer.allow_config_change=[model.lora]"):
        with pytest.raises(RunFolderError, match="other LoRA adapters") as refusal:
            check_run_folder(_config(files, run_dir, *extra, allowance), act=False)
        assert shown in str(refusal.value) and "set model.lora as the run had it" in str(refusal.value)


def test_the_adapters_scale_may_change_when_allowed_and_settings_of_lora_off_are_never_compared(files, tmp_path):
    lora_run, full_run = tmp_path / "lora", tmp_path / "full"
    _saved_run(lora_run, _config(files, lora_run, "model.lora.rank=4"))
    allow_alpha = r"model.lora.alpha: 32.0 -> 16.0.*allow_config_change=\[model.lora.alpha\]"
    with pytest.raises(RunFolderError, match=allow_alpha):
        check_run_folder(_config(files, lora_run, "model.lora.rank=4", "model.lora.alpha=16"), act=False)
    check_run_folder(_config(files, lora_run, "model.lora.rank=4", "model.lora.alpha=16",
                             "trainer.allow_config_change=[model.lora.alpha]"), act=False)
    _saved_run(full_run, _config(files, full_run))  # LoRA off: its targets and scale apply to nothing
    check_run_folder(_config(files, full_run, "model.lora.target_modules=[linear_qkv]", "model.lora.alpha=8"),
                     act=False)


def test_the_command_refuses_it_in_one_line_before_torch(files, tmp_path):
    run_dir = tmp_path / "run"
    _saved_run(run_dir, _config(files, run_dir, "model.lora.rank=4"))
    line = refused(files, "train", "--config", GRPO, f"model.hf_config={files['policy']}",
                   f"model.init_from={files['policy']}", f"data.train_file={files['prompts']}",
                   f"trainer.run_dir={run_dir}", "engine=deepspeed", "parallel.tensor=1", "model.lora.rank=8")
    assert line.startswith(f"grpo-mega train: error: trainer.run_dir={run_dir} holds a run with other LoRA adapters "
                           "(model.lora.rank: 4 -> 8)")


def test_lora_on_deepspeed_with_a_peft_that_does_not_import_names_the_key(monkeypatch):
    lora_on = SimpleNamespace(model=SimpleNamespace(lora=LoRAConfig(rank=4)), engine="deepspeed")
    monkeypatch.setitem(sys.modules, "peft", None)  # as a broken install or a shadowing folder: import fails
    with pytest.raises(ConfigError, match=r"model.lora with engine=deepspeed needs the peft package, which does "
                                          r"not import \(.*peft.*\): pip install 'grpo-mega\[deepspeed\]'"):
        check_lora_imports(lora_on)
    # nothing to import without LoRA, or on the Megatron engine (its own adapters)
    check_lora_imports(SimpleNamespace(model=SimpleNamespace(lora=LoRAConfig(rank=0)), engine="deepspeed"))
    check_lora_imports(SimpleNamespace(model=SimpleNamespace(lora=LoRAConfig(rank=4)), engine="megatron"))
