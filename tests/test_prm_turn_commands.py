"""``grpo-mega prm score`` and ``prm train`` on turn-split rows (what ``prm label --steps turns`` writes): a
likelihood PRM's score of each turn equals the policy's own minimum token probability over that turn's model tokens,
computed by hand from the policy's token ids (tool tokens in the input, not in the minimum; read at each turn's last
model token), and a PRM trains on the rows and scores every turn."""

from __future__ import annotations

import json

import pytest
import torch

from cli_runner import PRM_CONFIG, run_grpo_mega
from grpo_mega.reward import get_reward_function
from grpo_mega.rollout.base import SamplingConfig
from prm.data import write_stepwise
from prm.turn_labeling import monte_carlo_turn_labels, sample_turn_solutions
from prm.turn_steps import TURN_STEPS_FIELD, TurnSteps
from test_prm_turn_labeling import CountingTools, loop_of, records
from tiny_task import build_tiny_task


@pytest.fixture(scope="module")
def turn_rows(tmp_path_factory):
    """A tiny random policy (HF folder) and turn-split rows labelled through the turn loop with its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("turn_rows")
    model_dir, _ = build_tiny_task(root)
    policy = root / "policy_hf"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(policy)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (policy / name).write_bytes((model_dir / name).read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(policy)
    loop = loop_of(tokenizer, CountingTools())
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=120)
    sampled = sample_turn_solutions(loop, tokenizer, records(tokenizer), samples_per_prompt=1, sampling=sampling,
                                    seed=3)
    examples = monte_carlo_turn_labels(loop, sampled.items, n=2, sampling=sampling,
                                       reward_fn=get_reward_function("synthetic"), seed=4)
    rows = write_stepwise(root / "turns.jsonl", examples * 4)
    return {"model": model_dir, "policy": policy, "rows": rows, "examples": examples}


def _hand_scores(policy, example) -> list[float]:
    """min over each turn's model tokens of p(token | everything before it), from the policy's own ids."""
    from transformers import AutoModelForCausalLM

    steps = TurnSteps.from_row(example.extra[TURN_STEPS_FIELD], len(example.steps))
    ids = steps.prompt_ids + steps.response_ids
    model = AutoModelForCausalLM.from_pretrained(policy, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    offset = len(steps.prompt_ids)
    return [min(logprobs[t - 1, ids[t]].exp().item() for t in range(offset + first, offset + last + 1))
            for first, last in zip(steps.step_starts, steps.step_ends)]


@pytest.mark.slow
def test_a_likelihood_prm_scores_each_turn_on_its_own_tokens_and_trains_on_turn_rows(turn_rows, tmp_path):
    scored = tmp_path / "scores.jsonl"
    result = run_grpo_mega("prm", "score", "--prm", str(turn_rows["policy"]), "--layout", "likelihood", "--data",
                           str(turn_rows["rows"]), "--out", str(scored), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in scored.read_text().splitlines()]
    for line, example in zip(lines, turn_rows["examples"]):
        assert line["step_scores"] == pytest.approx(_hand_scores(turn_rows["policy"], example), rel=1e-4, abs=1e-6)

    run_dir = tmp_path / "prm"
    trained = run_grpo_mega(
        "prm", "train", "--config", str(PRM_CONFIG), f"model.hf_config={turn_rows['model']}",
        f"model.init_from={turn_rows['policy']}", f"data.train_file={turn_rows['rows']}", f"trainer.run_dir={run_dir}",
        "trainer.total_steps=2", "trainer.batch_size=4", "trainer.progress_bar=false", "trainer.tensorboard=false",
        "parallel.device=cpu", "data.max_length=256", "data.stop_at_first_bad_step=false", "optim.lr=1e-3",
        "optim.warmup_steps=0", timeout=600)
    assert trained.returncode == 0, trained.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["prm/loss"] > 0 for m in metrics)
    result = run_grpo_mega("prm", "score", "--prm", str(run_dir), "--data", str(turn_rows["rows"]), "--out",
                           str(scored), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    after = [json.loads(line)["step_scores"] for line in scored.read_text().splitlines()]
    assert [len(s) for s in after] == [len(e.steps) for e in turn_rows["examples"]] * 4
    assert after[:2] != [line["step_scores"] for line in lines[:2]]  # the trained PRM reads them differently
