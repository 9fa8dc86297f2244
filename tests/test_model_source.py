"""One source of model weights: every kind of path a user gives resolves once to the right ``ModelSource``.

The HF folders are the tiny Qwen2 models of test_prm_model.py; the checkpoints are published by the
``CheckpointManager`` itself around a stand-in for the engine's tensor files (resolving reads only the small files),
so no process group is needed. Loading each kind into the engines is covered by test_engine_reference.py,
test_training_checkpoint.py, test_engine_deepspeed.py and test_prm_model.py.
"""

import json
import re
import shutil

import pytest
import yaml
from test_prm_model import write_causal_lm, write_classifier_prm

from grpo_mega.checkpoint.mcore_checkpoint import FORMAT_NAME, FORMAT_VERSION, HF_FILES_DIR, INFO_FILE
from grpo_mega.checkpoint.source import resolve_model_source
from grpo_mega.checkpoint.training import CheckpointManager
from grpo_mega.checkpoint.training_files import (
    DEEPSPEED_METADATA,
    DIST_CHECKPOINT_METADATA,
    FORMAT_NAME as CHECKPOINT_FORMAT,
    FORMAT_VERSION as CHECKPOINT_VERSION,
)
from grpo_mega.run.layout import CHECKPOINTS_DIR, TMP_PREFIX, step_dir_name
from prm.spec import PRMChoices, check_layout_is_known, default_spec, spec_with_overrides, trained_spec


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"policy": write_causal_lm(root / "policy"), "classifier": write_classifier_prm(root / "classifier")}


def publish_checkpoint(run_dir, step, config, *, engine="megatron"):
    """A complete checkpoint of ``step`` in ``run_dir``, published as ``CheckpointManager.save`` publishes one; a
    one-byte stand-in for the engine's tensor files (Megatron's metadata.json, or DeepSpeed's marker)."""
    manager = CheckpointManager(run_dir, keep_last=5)
    final = manager.checkpoints_dir / step_dir_name(step)
    staging = manager.checkpoints_dir / f"{TMP_PREFIX}{final.name}"
    marker = staging / (DEEPSPEED_METADATA if engine == "deepspeed" else DIST_CHECKPOINT_METADATA)
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")
    info = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step, "engine": engine}
    manager._publish(staging, final, info, yaml.safe_dump(config))
    return final


def write_converted_folder(hf_folder, out):
    """A converted megatron folder's small files: grpo_mega_model.json and the HF side files in hf/."""
    shutil.copytree(hf_folder, out / HF_FILES_DIR, ignore=shutil.ignore_patterns("*.safetensors"))
    (out / INFO_FILE).write_text(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "dtype": "float32"}))
    return out


def test_hf_folder(models):
    source = resolve_model_source(models["policy"])
    assert (source.kind, source.folder, source.hf_config_folder) == ("hf", models["policy"], models["policy"])
    assert source.tokenizer_folder == models["policy"]
    assert source.hf_config.architectures == ["Qwen2ForCausalLM"] and source.hf_config.vocab_size == 301
    assert (source.run_config, source.saved_by, source.trained_prm, source.is_checkpoint) == (None, None, {}, False)
    assert resolve_model_source(source) is source
    assert trained_spec(resolve_model_source(models["classifier"])) == default_spec("classifier")
    assert trained_spec(source) == default_spec("lm_tokens")


def test_converted_folder(models, tmp_path):
    folder = write_converted_folder(models["classifier"], tmp_path / "mcore")
    source = resolve_model_source(folder)
    assert (source.kind, source.folder, source.hf_config_folder) == ("mcore_model", folder, folder / HF_FILES_DIR)
    assert source.tokenizer_folder == folder / HF_FILES_DIR
    assert source.hf_config.architectures == ["Qwen2ForProcessRewardModel"]
    assert trained_spec(source) == default_spec("classifier")


def test_run_directory_and_checkpoint_folder(models, tmp_path):
    run_dir = tmp_path / "run"
    prm = {"layout": "lm_tokens", "step_tag": "\n\n", "good_token": "+", "bad_token": "-", "chat_template": True,
           "system_prompt": "Check.", "likelihood_tokens": "all", "pos_weight": 1.0}
    config = {"model": {"hf_config": str(models["policy"]), "tokenizer": str(models["classifier"])}, "prm": prm}
    publish_checkpoint(run_dir, 1, {"model": {"hf_config": str(models["policy"])}})
    newest = publish_checkpoint(run_dir, 2, config)
    source = resolve_model_source(run_dir)
    assert (source.kind, source.folder, source.saved_by) == ("training_run", newest, "megatron")
    assert (source.hf_config_folder, source.tokenizer_folder) == (models["policy"], models["classifier"])
    assert source.hf_config.architectures == ["Qwen2ForCausalLM"]
    assert source.run_config == config and source.trained_prm == prm and source.is_checkpoint
    spec = trained_spec(source)
    assert (spec.layout, spec.step_tag) == ("lm_tokens", "\n\n")
    render = PRMChoices(likelihood_tokens="result").render_settings(spec, source)
    assert (render.step_tag, render.chat_template, render.system_prompt, render.likelihood_tokens) == (
        "\n\n", True, "Check.", "result")

    first = resolve_model_source(run_dir / CHECKPOINTS_DIR / step_dir_name(1))
    assert (first.kind, first.folder, first.tokenizer_folder) == (
        "training_checkpoint", run_dir / CHECKPOINTS_DIR / step_dir_name(1), models["policy"])
    assert first.trained_prm == {}  # a policy's checkpoint: a PRM only as a likelihood one, chosen explicitly
    assert trained_spec(first, "likelihood") == default_spec("likelihood")
    with pytest.raises(ValueError, match="no prm section"):
        trained_spec(first)
    with pytest.raises(ValueError, match="choose process_reward.layout likelihood"):
        check_layout_is_known(first.folder, "process_reward.layout")
    check_layout_is_known(run_dir, "process_reward.layout")  # a PRM's checkpoint knows its layout


def test_deepspeed_checkpoint_and_a_checkpoint_without_hf_config(tmp_path):
    folder = publish_checkpoint(tmp_path / "run", 3, {"model": {}}, engine="deepspeed")
    source = resolve_model_source(folder)
    assert (source.kind, source.saved_by) == ("training_checkpoint", "deepspeed")
    assert (source.hf_config, source.hf_config_folder, source.tokenizer_folder) == (None, None, None)


def test_folders_that_are_no_model(models, tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} is none of: a grpo-mega checkpoint")):
        resolve_model_source(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_model_source(tmp_path / "missing")
    (tmp_path / "empty_run" / CHECKPOINTS_DIR).mkdir(parents=True)
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        resolve_model_source(tmp_path / "empty_run")
    check_layout_is_known(tmp_path, "--layout")  # no model: open_prm reports it
    with pytest.raises(ValueError, match="choose one with --layout"):
        check_layout_is_known(models["policy"], "--layout")
    check_layout_is_known(models["classifier"], "--layout")


def test_the_likelihood_layout_has_no_tag():
    lm_tokens = default_spec("lm_tokens")
    assert spec_with_overrides(lm_tokens, {"layout": "likelihood"}) == default_spec("likelihood")
    assert spec_with_overrides(lm_tokens, {"step_tag": "\n"}).step_tag == "\n"
    with pytest.raises(ValueError, match='prm.step_tag must be ""'):
        spec_with_overrides(lm_tokens, {"layout": "likelihood", "step_tag": " ки"})
    assert PRMChoices(layout="likelihood", chat_template=False).spec_overrides() == {"layout": "likelihood"}
