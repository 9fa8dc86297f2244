"""Cross-field constraints of every config checked at start-up, each message naming the keys and the fix
(issue 30, item 2): what used to be a bare AssertionError in megatron's scheduler, or a guess."""

from __future__ import annotations

import json

import pytest

from grpo_mega.cli import main
from grpo_mega.config import ConfigError, GRPOConfig, SFTConfig, load_config, validate, validate_sft
from prm.config import PRMConfig, validate_prm

BASE = {
    GRPOConfig: (validate, ["data.train_file=x.jsonl", "model.hf_config=m"]),
    SFTConfig: (validate_sft, ["data.train_file=x.jsonl", "model.hf_config=m"]),
    PRMConfig: (validate_prm, ["data.train_file=x.jsonl", "model.hf_config=m"]),
}
EVERY = [
    (["optim.lr=1e-5", "optim.min_lr=3e-4"], r"optim.min_lr=0.0003 must be between 0 and optim.lr=1e-05.*lower "
                                            r"optim.min_lr too \(e.g. optim.min_lr=1e-06"),
    (["optim.lr=0"], r"optim.lr=0.0 must be > 0"),
    (["optim.warmup_steps=-1"], r"optim.warmup_steps=-1 must be >= 0"),
    (["optim.adam_beta2=1.0"], r"optim.adam_beta2=1.0 must be in \[0, 1\)"),
    (["parallel.tensor=0"], r"parallel.tensor=0 must be >= 1"),
    (["trainer.loggers=[tensorboard]"], r"trainer.loggers=\['tensorboard'\] must include jsonl"),
    (["trainer.loggers=[jsonl,mlflow]"], r"trainer.loggers='mlflow': expected one of \('jsonl', 'tensorboard', 'wandb'\)"),
    (["trainer.wandb_mode=cloud"], r"trainer.wandb_mode='cloud'"),
]


@pytest.mark.parametrize("schema", list(BASE), ids=lambda s: s.__name__)
@pytest.mark.parametrize("overrides,message", EVERY, ids=[case[0][0] for case in EVERY])
def test_every_config_checks_shared_constraints(schema, overrides, message):
    validator, base = BASE[schema]
    with pytest.raises(ConfigError, match=message):
        load_config(schema, None, [*base, *overrides], validator)


def test_defaults_pass():
    for schema, (validator, base) in BASE.items():
        load_config(schema, None, base, validator)


def test_grpo_constraints_name_their_keys(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    cases = [
        ([f"model.hf_config={model}", "data.prompt_length=400", "algorithm.response_length=256"],
         r"data.prompt_length \+ algorithm.response_length = 656 tokens is more than the model's "
         r"max_position_embeddings=512"),
        (["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=0"], r"algorithm.max_sampling_rounds=0"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(GRPOConfig, None, ["data.train_file=x.jsonl", "model.hf_config=m", *overrides], validate)


def test_prm_constraints_name_their_keys():
    cases = [
        (["prm.layout=lm_tokens", "prm.good_token=+", "prm.bad_token=+"], "prm.good_token and prm.bad_token"),
        (["prm.system_prompt=hi"], "set prm.chat_template=true"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(PRMConfig, None, ["data.train_file=x.jsonl", "model.hf_config=m", *overrides], validate_prm)


def test_cli_reports_the_keys_not_a_traceback(tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("optim:\n  lr: 1.0e-5\n  min_lr: 3.0e-4\n")
    assert main(["sft", "--config", str(config), "model.hf_config=m", "data.train_file=x.jsonl"]) == 2
    err = capsys.readouterr().err
    # before any rank starts (no launcher): the error alone, one line (a rank's line with cause=config under one)
    assert err.startswith("grpo-mega sft: error: optim.min_lr=0.0003 must be between 0 and optim.lr=1e-05")
    assert len(err.strip().splitlines()) == 1
