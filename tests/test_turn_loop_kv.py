"""The hf engine continues each row's KV cache across tool turns (``HFRolloutEngine.generate_with_caches``, used by
the turn loop whenever the engine ``continues_kv``): the trajectories equal the recomputing path's (every turn's
prefix put through the model again) at temperature 0 and, with a fixed seed, at temperature 1 (the same random
numbers), also when the stop strings are found only at checkpoints (CUDA's ``sync_every``); later turns prefill
only the last sampled token and the tool turn; a cache is checked against its prompt.

The policy is a random tiny Qwen2 with real attention whose ``</tool_call>`` and EOS logits are read off one
hidden dimension each (a boosted final-norm weight), so rows call the (invalid, then answered-with-an-error) tool
after context-dependent numbers of tokens and end at different turns, in batches of several lengths."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import grpo_mega.rollout.hf_engine as hf_engine
from grpo_mega.data.tokenizer import train_tokenizer
from grpo_mega.rollout.base import SamplingConfig
from grpo_mega.rollout.hf_decode import decode
from grpo_mega.rollout.hf_engine import HFRolloutEngine
from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings
from turn_loop_doubles import Calculator

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
TEXTS = ["Q: what is 12 * 34? A: The answer is 408.", CALL % "12 * 34", "<tool_response>408</tool_response>"] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = train_tokenizer(TEXTS, tmp_path_factory.mktemp("tok"), vocab_size=400)
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return tok


def tool_calling_model(tokenizer, **config) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, **config)
    model = Qwen2ForCausalLM(cfg).eval()
    call = tokenizer.convert_tokens_to_ids("</tool_call>")
    with torch.no_grad():
        model.model.norm.weight[:2] = 8.0
        for token, dim, boost in ((call, 0, 1.0), (tokenizer.eos_token_id, 1, 0.7)):
            model.lm_head.weight[token] = 0.0
            model.lm_head.weight[token, dim] = boost
    return model


def prompts(tokenizer):
    return [tokenizer.encode(f"Q{p}: what is {p} * 34? A:" + " x" * p, add_special_tokens=False) for p in range(5)]


def rollouts(engine, tokenizer, temperature, *, continues_kv):
    loop = TurnLoopEngine(engine, Calculator(), tokenizer,
                          TurnLoopSettings(max_response_tokens=120, max_turns=4, max_tokens_per_turn=40))
    assert loop.continues_kv  # the hf engine on a full-attention model: chosen automatically
    loop.continues_kv = continues_kv
    widths: list[list[int]] = []  # per engine call, the positions per row of each forward pass
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths[-1].append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    call = engine.generate_with_caches  # generate calls it too
    engine.generate_with_caches = lambda *args, **kwargs: widths.append([]) or call(*args, **kwargs)
    try:
        out = loop.generate(prompts(tokenizer), SamplingConfig(temperature=temperature, n=3, max_new_tokens=120,
                                                               seed=5))
    finally:
        hook.remove()
        del engine.generate_with_caches
    return out, widths


@pytest.mark.parametrize("temperature,sync_every", [(0.0, None), (1.0, None), (1.0, 4)])
def test_continuing_the_cache_gives_the_recomputed_trajectories_and_prefills_only_the_tool_turn(
        tokenizer, monkeypatch, temperature, sync_every):
    if sync_every is not None:  # stop strings found only every 4 steps, as on CUDA: tokens past them, compactions
        monkeypatch.setattr(hf_engine, "decode", functools.partial(decode, sync_every=sync_every))
    engine = HFRolloutEngine(tool_calling_model(tokenizer), tokenizer, generation_batch_size=2)
    ours, ours_widths = rollouts(engine, tokenizer, temperature, continues_kv=True)
    recomputed, recomputed_widths = rollouts(engine, tokenizer, temperature, continues_kv=False)

    assert [c.response_ids for c in ours] == [c.response_ids for c in recomputed]
    for a, b in zip(ours, recomputed):
        assert (a.response_mask, a.finish_reason, a.text) == (b.response_mask, b.finish_reason, b.text)
        assert [(t.start, t.end, t.tool_end, t.ended) for t in a.turns] == \
            [(t.start, t.end, t.tool_end, t.ended) for t in b.turns]
        assert torch.allclose(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5)
    turns = [len(c.turns) for c in ours]
    assert max(turns) >= 3 and min(turns) == 1 and sum(len(t) > 1 for t in ours_widths[1:]) > 0  # a real test

    # Later turns put through the model only each row's last sampled token and its tool turn, never its prefix.
    # Both paths make the same calls, batches and decode steps: their forward passes pair up one to one.
    tool_turn = max(t.tool_end - t.end for c in ours for t in c.turns if t.tool_end is not None)
    shortest_prompt = min(len(p) for p in prompts(tokenizer))
    assert [len(call) for call in ours_widths] == [len(call) for call in recomputed_widths]
    later = [(a, b) for ours_call, recomputed_call in zip(ours_widths[1:], recomputed_widths[1:])
             for a, b in zip(ours_call, recomputed_call) if b > 1]
    assert later and all(a <= 1 + tool_turn and a <= b - shortest_prompt for a, b in later)


def test_a_cache_must_hold_its_prompts_first_tokens_and_continues_one_sample(tokenizer):
    engine = HFRolloutEngine(tool_calling_model(tokenizer), tokenizer)
    prompt = prompts(tokenizer)[0]  # greedy: a call first
    sampling = SamplingConfig(temperature=0, n=1, max_new_tokens=40, stop=["</tool_call>"])
    out, kept = engine.generate_with_caches([prompt], sampling, keep=True)
    assert out[0].finish_reason == "stop" and kept[0] is not None
    assert kept[0].token_ids == tuple(prompt + out[0].response_ids[:-1])
    prefix = prompt + out[0].response_ids + tokenizer.encode("<tool_response>1</tool_response>",
                                                             add_special_tokens=False)
    continued, _ = engine.generate_with_caches([prefix], sampling, [kept[0]])
    assert continued[0].response_ids == engine.generate([prefix], sampling)[0].response_ids
    other = [prefix[0] + 1] + prefix[1:]
    with pytest.raises(ValueError, match="does not hold its prompt's first tokens"):
        engine.generate_with_caches([other], sampling, [kept[0]])
    with pytest.raises(ValueError, match="n=2"):
        engine.generate_with_caches([prefix], SamplingConfig(n=2, max_new_tokens=4), [kept[0]])


def test_a_model_with_sliding_window_layers_recomputes(tokenizer):
    model = tool_calling_model(tokenizer, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    engine = HFRolloutEngine(model, tokenizer)
    assert not engine.continues_kv
    assert not TurnLoopEngine(engine, Calculator(), tokenizer, TurnLoopSettings(max_response_tokens=8)).continues_kv
