"""The vllm engine's code paths that need no GPU: the install error, sampling parameters, output conversion,
and the driver-side weight checks. vLLM itself cannot run here (CUDA builds only)."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_mega.rollout import SamplingConfig, build_rollout_engine
from grpo_mega.rollout.vllm_engine import _reference_state_dict, completions_from_vllm, vllm_sampling_kwargs
from grpo_mega.rollout.weight_tracking import WeightUpdateTracker


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_building_without_vllm_names_the_install_command(tmp_path):
    with pytest.raises(ImportError, match=r"pip install 'grpo-mega\[gpu\]'"):
        build_rollout_engine("vllm", model_path=tmp_path, tokenizer=tmp_path, dtype="bf16")


def test_sampling_kwargs_always_set_max_tokens_and_keep_stop_strings():
    kwargs = vllm_sampling_kwargs(SamplingConfig(temperature=0.8, top_k=5, max_new_tokens=300, stop=["\n"], n=4), 7)
    assert kwargs["max_tokens"] == 300  # vLLM's default is 16
    assert kwargs["n"] == 4 and kwargs["seed"] == 7 and kwargs["top_k"] == 5 and kwargs["temperature"] == 0.8
    assert kwargs["include_stop_str_in_output"] is True and kwargs["stop"] == ["\n"]
    assert kwargs["logprobs"] == 0  # the sampled token's log-prob only
    assert vllm_sampling_kwargs(SamplingConfig(temperature=0, n=4), 0)["n"] == 1  # vLLM: greedy needs n == 1
    assert vllm_sampling_kwargs(SamplingConfig(), 0)["stop"] is None


def sample(index, token_ids, logprobs, finish_reason, stop_reason=None):
    """The fields of a vLLM CompletionOutput that the engine reads; logprobs as vLLM returns them for
    logprobs=0: one {token_id: Logprob} dict per generated token."""
    return SimpleNamespace(
        index=index,
        token_ids=token_ids,
        logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(token_ids, logprobs)],
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )


def decode(ids):
    return "".join(chr(ord("a") + i) for i in ids if i != 0)  # token 0 plays EOS, skipped like a special token


def test_completions_from_vllm_outputs():
    outputs = [
        SimpleNamespace(outputs=[  # vLLM may list samples out of order: sorted by index
            sample(1, [3, 4, 0], [-0.1, -0.2, -0.3], "stop", None),
            sample(0, [1, 2], [-1.0, -2.0], "stop", "c"),
        ]),
        SimpleNamespace(outputs=[
            sample(0, [5, 6, 7], [-0.5, -0.6, -0.7], "length"),
            sample(1, [8, 9], [-0.8, -0.9], "stop", 9),  # a generation_config EOS id (stop_token_ids)
        ]),
    ]
    completions = completions_from_vllm(outputs, [[10], [11, 12]], 2, decode)
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
    assert [c.prompt_ids for c in completions] == [[10], [10], [11, 12], [11, 12]]
    assert [c.finish_reason for c in completions] == ["stop", "eos", "length", "eos"]
    assert completions[1].response_ids == [3, 4, 0] and completions[1].text == "de"
    assert completions[2].response_logprobs == [-0.5, -0.6, -0.7]


def test_greedy_output_is_copied_n_times_and_aborts_raise():
    greedy = [SimpleNamespace(outputs=[sample(0, [1], [-0.1], "length")])]
    completions = completions_from_vllm(greedy, [[10]], 3, decode)
    assert len(completions) == 3 and all(c.response_ids == [1] for c in completions)
    assert completions[0].response_ids is not completions[1].response_ids
    aborted = [SimpleNamespace(outputs=[sample(0, [1], [-0.1], "abort")])]
    with pytest.raises(RuntimeError, match="abort"):
        completions_from_vllm(aborted, [[10]], 1, decode)
    with pytest.raises(RuntimeError, match="2 samples for prompt 0, expected 3"):
        completions_from_vllm([SimpleNamespace(outputs=[greedy[0].outputs[0]] * 2)], [[10]], 3, decode)


def test_reference_names_and_shapes_from_config_folder(tmp_path):
    """The vllm engine checks incoming tensors against a meta-device model built from config.json."""
    config = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    real = Qwen2ForCausalLM(config).state_dict()
    reference = _reference_state_dict(tmp_path)
    assert {n: tuple(t.shape) for n, t in reference.items()} == {n: tuple(t.shape) for n, t in real.items()}
    assert all(t.device.type == "meta" for t in reference.values())
    tracker = WeightUpdateTracker(reference)
    tracker.begin()
    for name, tensor in real.items():
        if name != "lm_head.weight":  # tied: the embedding delivers it
            tracker.accept(name, tensor)
    tracker.finish()
    tracker.begin()
    with pytest.raises(ValueError, match="lm_head.weight"):
        tracker.accept("lm_head.weight", torch.zeros(40, 15))
