"""Tree rollouts (``process_reward.source: tree``): the sampler's tree on the hf engine with the tiny task's model
(shared prefixes, the policy's own log-probs of every leaf, reproducible from its seed), the bookkeeping of nodes
that end early, and the step rewards from node values with the answer guard."""

import math

import pytest
import torch

from grpo_mega.config import ProcessRewardConfig
from grpo_mega.data.tokenizer import load_tokenizer
from grpo_mega.rollout import build_rollout_engine
from grpo_mega.rollout.base import Completion, SamplingConfig, decode_response
from grpo_mega.stages.answer_guard import AnswerGuard
from grpo_mega.stages.tree_rollout import TreeSampler, TreeStepRewards
from tiny_task import build_padded_model


@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory):
    model_dir, _, _ = build_padded_model(tmp_path_factory.mktemp("task"), 0)  # the tiny task's, random weights
    tokenizer = load_tokenizer(str(model_dir))
    engine = build_rollout_engine("hf", model_path=model_dir, tokenizer=tokenizer, dtype="fp32")
    prompts = [tokenizer.encode("Q: 3 + 4 * 2 = ? A:"), tokenizer.encode("Q: 12 - 5 * 2 = ? A:")]
    return model_dir, tokenizer, engine, prompts


def sample(hf_setup, branching=(2, 2, 2), segment_tokens=3, seed=5, max_new_tokens=12):
    _, tokenizer, engine, prompts = hf_setup
    sampler = TreeSampler(branching, segment_tokens, lambda ids: decode_response(tokenizer, ids))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, n=8)
    return sampler, sampler.generate(engine, prompts, sampling, call_seed=seed)


def test_a_group_is_the_trees_leaves_with_shared_prefixes(hf_setup):
    sampler, rows = sample(hf_setup)
    assert len(rows) == 2 * 8 and [c.prompt_index for c in rows] == [0] * 8 + [1] * 8
    for group in (rows[:8], rows[8:]):
        for a in group:
            for b in group:  # rows through the same node share its whole response so far, log-probs included
                shared = 0
                while shared < min(len(a.tree_path), len(b.tree_path)) and a.tree_path[shared] == b.tree_path[shared]:
                    shared += 1
                tokens = min(shared * 3, len(a.response_ids), len(b.response_ids))
                assert a.response_ids[:tokens] == b.response_ids[:tokens]
                assert a.response_logprobs[:tokens] == b.response_logprobs[:tokens]
        first = {tuple(c.tree_path[:1]) for c in group}
        assert len(first) == 2  # the root's two children
        # a node that ended before the last level fills all the rows of its subtree
        for path in {tuple(c.tree_path) for c in group}:
            copies = sum(tuple(c.tree_path) == path for c in group)
            assert copies == math.prod((2, 2, 2)[len(path):])
        for c in group:
            assert c.segment_ends == [3 * k + 2 for k in range(len(c.tree_path) - 1)]
            assert len(c.response_ids) <= 12 and len(c.response_logprobs) == len(c.response_ids)
            assert c.text == decode_response(hf_setup[1], c.response_ids)
    metrics = sampler.metrics
    distinct = {(c.prompt_index, tuple(c.tree_path[:depth + 1])) for c in rows for depth in range(len(c.tree_path))}
    assert metrics["rollout/tree/nodes"] == len(distinct)
    assert metrics["rollout/tree/leaves"] == len({(c.prompt_index, tuple(c.tree_path)) for c in rows})
    # every node's segment counted once: fewer tokens than the rows hold
    assert metrics["rollout/tree/generated_tokens"] < sum(len(c.response_ids) for c in rows)
    assert metrics["timing_s/tree_sampling"] > 0


def test_the_trees_log_probs_are_the_policys_and_its_seed_fixes_it(hf_setup):
    from transformers import AutoModelForCausalLM

    model_dir, _, _, prompts = hf_setup
    _, rows = sample(hf_setup)
    _, again = sample(hf_setup)
    _, other = sample(hf_setup, seed=6)
    assert [c.response_ids for c in again] == [c.response_ids for c in rows]
    assert [c.response_ids for c in other] != [c.response_ids for c in rows]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for c in rows[::3]:  # each leaf's log-probs, gathered over several generate calls, are one forward's
        ids = torch.tensor([prompts[c.prompt_index] + c.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompts[c.prompt_index]) - 1:-1]
        expected = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(c.response_ids)[:, None])[:, 0]
        assert torch.tensor(c.response_logprobs) == pytest.approx(expected, abs=1e-4)


class ScriptedEngine:
    """Answers each request with the next scripted segments (token ids, finish reason), n per request: enough to
    put an early end exactly where a test wants it."""

    def __init__(self, script):
        self.script = list(script)
        self.calls = []

    def generate(self, prompt_ids, sampling):
        self.calls.append(([list(p) for p in prompt_ids], sampling.n, sampling.max_new_tokens))
        out = []
        for p, _ in enumerate(prompt_ids):
            for _ in range(sampling.n):
                ids, finish = self.script.pop(0)
                out.append(Completion(p, list(prompt_ids[p]), ids, [-0.1] * len(ids), "", finish))
        return out


def test_a_node_that_ends_early_stands_for_its_subtree():
    # [2, 2] with 2-token segments: the root's first child ends (eos) in the first segment, the second continues
    engine = ScriptedEngine([([5], "eos"), ([6, 7], "length"), ([8, 9, 1], "eos"), ([10], "length")])
    sampler = TreeSampler([2, 2], 2, lambda ids: " ".join(map(str, ids)))
    rows = sampler.generate(engine, [[1, 2]], SamplingConfig(max_new_tokens=5, n=4), call_seed=0)
    assert [c.response_ids for c in rows] == [[5], [5], [6, 7, 8, 9, 1], [6, 7, 10]]
    assert [c.tree_path for c in rows] == [[0], [0], [1, 2], [1, 3]]
    assert [c.segment_ends for c in rows] == [[], [], [1], [1]]
    # level 0: the prompt, 2 children of at most 2 tokens; level 1: prompt + prefix, the remaining 3 tokens
    assert engine.calls == [([[1, 2]], 2, 2), ([[1, 2, 6, 7]], 2, 3)]
    assert sampler.metrics["rollout/tree/generated_tokens"] == 1 + 2 + 3 + 1
    assert sampler.metrics["rollout/tree/leaves"] == 3 and sampler.metrics["rollout/tree/mean_depth"] == 5 / 3


def test_step_rewards_are_node_values_cut_at_the_answer():
    """Each segment's step is scored by its node's value; progress rewards telescope to the outcome minus the
    group's mean; the guard drops a segment that ends after the answer and ends the answer's step at it."""
    decode = lambda ids: "".join(chr(i) for i in ids)  # one character per token
    texts = ["ab The answer is 4. xx", "ab cd", "ef The answer is 5.", "ef gh"]
    sampler = TreeSampler([2, 2], 2, decode)
    rows = [Completion(0, [1], [ord(ch) for ch in text], [0.0] * len(text), text, "eos", tree_path=path,
                       segment_ends=[1]) for text, path in zip(texts, [[0, 2], [0, 3], [1, 4], [1, 5]])]
    outcomes = [1.0, 0.0, 0.0, 0.0]
    settings = ProcessRewardConfig(source="tree", step_reward="progress")
    source = TreeStepRewards(sampler, settings, AnswerGuard())
    rewards, ends, metrics = source(["Q"] * 4, texts, outcomes, [{}] * 4, completions=rows)
    answer_end = texts[0].index("4.") + 2
    assert ends[0] == [2, answer_end]  # the segment's end, then the answer's (the text after it closed)
    assert rewards[0] == pytest.approx([0.5 - 0.25, 1.0 - 0.5])  # V(node 0) - V(root), o - V(node 0)
    assert ends[1] == [2, len(texts[1]), len(texts[1]) + 1]  # no answer: the guard's missing-answer step
    assert rewards[1] == pytest.approx([0.5 - 0.25, 0.0 - 0.5, 0.0])
    assert rewards[2] == pytest.approx([0.0 - 0.25, 0.0])
    assert metrics["tree/steps_per_completion"] == 2.5
    with pytest.raises(ValueError, match="TreeSampler"):
        source(["Q"] * 4, texts, outcomes, [{}] * 4, completions=[Completion(0, [1], [1], [0.0], "a", "eos")] * 4)


def test_every_configurable_source_is_registered():
    """``process_reward.source``'s choices (checked by the config, which cannot import the stages) are the
    registered step-reward sources."""
    from grpo_mega.config import PROCESS_REWARD_SOURCES
    from grpo_mega.stages.step_sources import STEP_REWARD_SOURCES, register_step_reward_source

    assert sorted(STEP_REWARD_SOURCES) == sorted(PROCESS_REWARD_SOURCES)
    with pytest.raises(ValueError, match="registered twice"):
        register_step_reward_source("tree")(lambda cfg, decode: None)
