"""The PRM on a plain causal LM (issue 30, item 6): no silent ``lm_tokens`` (the layout must be chosen, and the
error names the flag or key), and the ``likelihood`` layout's ``result`` reduction, which reads a natural-language
step's result instead of its least likely wording token. No processes: the small chat model's tokenizer, and the
likelihood head's reduction on hand-set token log-probabilities."""

from __future__ import annotations

import argparse

import pytest
import torch
from small_model import build_tokenizer, gsm8k_rows, llama_config, tokenizer_texts

from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
from prm.heads import step_likelihood_outputs
from prm.rendering import RenderSettings, result_spans, tokenize_rendered
from prm.scoring import add_score_arguments, open_scorer, rendered_batch

PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?"
STEPS = ["In May, Natalia sold 48 / 2 = 24 clips.", "Altogether she sold 48 + 24 = {} clips in April and May."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    return build_tokenizer(tokenizer_texts(gsm8k_rows(64)) + [PROMPT, *STEPS], folder)


def test_result_spans_read_the_numbers_after_the_last_equals():
    step = "Altogether she sold 48 + 24 = 72 clips."
    assert [step[a:b] for a, b in result_spans(step)] == ["72"]
    plain = "She has 1,250 stickers and 3.5 boxes."
    assert [plain[a:b] for a, b in result_spans(plain)] == ["1,250", "3.5"]
    assert result_spans("First, find the total.") == [(0, len("First, find the total."))]


def _scores(tokenizer, answer: str, likelihood_tokens: str) -> list[float]:
    """Step scores of (PROMPT, STEPS with ``answer``) under a model that finds the word "Altogether" unlikely
    (log p = -6) and the second step's result likely when it is 72 (-0.05) and unlikely otherwise (-4); every
    other token -0.5."""
    steps = [STEPS[0], STEPS[1].format(answer)]
    settings = RenderSettings(step_tag="", likelihood_tokens=likelihood_tokens)
    rendered = tokenize_rendered(tokenizer, PROMPT, steps, settings)
    batch = rendered_batch([rendered], tokenizer.pad_token_id, step_ids=True)
    ids = rendered.input_ids
    logprobs = torch.full((1, len(ids)), -0.5)
    text_so_far = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    for index, text in enumerate(text_so_far):
        piece = tokenizer.decode([ids[index]])
        if "Altogether" in text and "Altogether" not in text_so_far[index - 1]:
            logprobs[0, index] = -6.0  # the token that completes the unusual word
        if text.endswith(answer) and text.count("=") == 2 and piece.strip() and piece.strip() in answer:
            logprobs[0, index] = -0.05 if answer == "72" else -4.0
    outputs = step_likelihood_outputs(logprobs, batch["step_ids"], batch.get("step_counted"))
    return torch.exp(outputs["good_logprob"][0, rendered.tag_positions]).tolist()


def test_result_reduction_tells_a_minimal_pair_apart(tokenizer):
    # all tokens: the wording token is the least likely in both, so 72 and 62 score the same (the report)
    right_all, wrong_all = _scores(tokenizer, "72", "all"), _scores(tokenizer, "62", "all")
    assert right_all[1] == pytest.approx(wrong_all[1]) == pytest.approx(float(torch.exp(torch.tensor(-6.0))))
    # result tokens: the step's result decides
    right, wrong = _scores(tokenizer, "72", "result"), _scores(tokenizer, "62", "result")
    assert right[1] > 0.9 and wrong[1] < 0.05
    assert right[0] == pytest.approx(wrong[0]) == pytest.approx(float(torch.exp(torch.tensor(-0.5))))


def test_counted_tokens_are_the_result_tokens(tokenizer):
    rendered = tokenize_rendered(tokenizer, PROMPT, [STEPS[0], STEPS[1].format("72")],
                                 RenderSettings(step_tag="", likelihood_tokens="result"))
    assert [tokenizer.decode([rendered.input_ids[i] for i in step]).strip() for step in rendered.counted] == ["24", "72"]


def test_a_causal_lm_needs_an_explicit_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    config = llama_config(layers=1)
    config.vocab_size, config.hidden_size, config.intermediate_size = 64, 64, 64
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "lm")
    parser = argparse.ArgumentParser()
    add_score_arguments(parser)
    args = parser.parse_args(["--prm", str(tmp_path / "lm"), "--data", "x.jsonl", "--out", "y.jsonl"])
    with pytest.raises(ValueError, match="choose one with --layout: lm_tokens .* or likelihood"):
        open_scorer(args)
    with pytest.raises(ConfigError, match="choose one with process_reward.layout"):
        load_config(GRPOConfig, None, ["model.hf_config=m", "data.train_file=x", "algorithm.supervision=process",
                                       "process_reward.source=prm", f"process_reward.prm={tmp_path / 'lm'}"], validate)
    load_config(GRPOConfig, None, ["model.hf_config=m", "data.train_file=x", "algorithm.supervision=process",
                                   "process_reward.source=prm", f"process_reward.prm={tmp_path / 'lm'}",
                                   "process_reward.layout=likelihood", "process_reward.likelihood_tokens=result"],
                validate)
