"""``grpo-mega train`` with ``rollout.multi_turn`` end to end: the hf engine samples a tiny Qwen2 policy that calls a
calculator, the tool turn comes back, the policy answers, the reward reads the whole trajectory and the update
trains on the policy's tokens only.

The policy is a random-free "bigram" Qwen2 (1 layer whose attention and MLP outputs are zero, so each position's
logits depend on its own token only): after any ordinary token it writes ``<tool_call>``, then a one-token call
body, then ``</tool_call>`` (the stop string: the calculator runs); after ``</tool_response>`` it writes one of two
answer tokens with equal probability (rewards differ within a group), then EOS. So every rollout has two turns,
the tool turn in between, whatever the sampling seed.

The tools come from ``grpo_mega.tools`` when it is installed; until the sandbox branch is merged the command's
process gets this file's calculator under that name (``turn_loop_doubles.Calculator``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_mega.run.metrics import read_metrics
from tiny_task import build_tiny_task

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart_grpo.yaml"
CALL_BODY = '{"name": "calculator", "arguments": {"expression": "6 * 7"}}'
ANSWERS = ("The answer is 42.", "The answer is 41.")
SCRIPTED = ["<tool_call>", CALL_BODY, "</tool_call>", "<tool_response>", "</tool_response>", *ANSWERS]
REWARD = '''
def reward(prompt: str, completion: str, answer: str, **extra) -> float:
    return float(completion.endswith("The answer is 42."))
'''
# the command's process: the in-test calculator as grpo_mega.tools while the sandbox package is not installed
RUNNER = '''
import sys, types
sys.path[:0] = [{tests!r}, {root!r}]
try:
    import grpo_mega.tools
except ImportError:
    import turn_loop_doubles
    tools = types.ModuleType("grpo_mega.tools")
    tools.SandboxConfig = lambda **fields: fields
    tools.build_toolset = lambda specs, sandbox: turn_loop_doubles.Calculator()
    tools.check_tool_specs = lambda specs: None
    sys.modules["grpo_mega.tools"] = tools
from grpo_mega.cli import main
sys.exit(main(sys.argv[1:]))
'''


def build_bigram_policy(model_dir: Path, folder: Path, *, second_answer_margin: float = 0.0,
                        call_bodies: tuple[str, ...] = (CALL_BODY,), num_layers: int = 1) -> Path:
    """The scripted policy of the module docstring: the tiny task's tokenizer with the script's pieces added as
    (non-special) tokens, and a 1-layer Qwen2 whose logits at a position are a table of its token (head_dim 32: vLLM's
    CPU attention has no kernel for 16).
    ``second_answer_margin``: how much less likely (in logit / 8) the second answer is (0: a coin flip; > 0: greedy
    decoding picks the first). ``call_bodies``: the calls the policy writes after ``<tool_call>``, each as likely.
    ``num_layers``: more layers for a pipeline of stages, each as silent as the first (the same policy)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    scripted = ["<tool_call>", *call_bodies, "</tool_call>", "<tool_response>", "</tool_response>", *ANSWERS]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(scripted)
    ids = {piece: tokenizer.convert_tokens_to_ids(piece) for piece in scripted}
    eos = tokenizer.eos_token_id
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                         pad_token_id=tokenizer.pad_token_id, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # no attention output, no MLP output: the residual is the embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 16:].normal_(0.0, 0.1)  # ordinary tokens: a shared direction (dim 0) plus a little noise
        embed[:, 0] = 1.0
        own = {token: 1 + k for k, token in enumerate(scripted)}  # the scripted tokens' own directions
        for piece, dim in own.items():
            embed[ids[piece], 16:] = 0.0
            embed[ids[piece], dim] = 8.0
        head = model.lm_head.weight
        head.zero_()
        head[ids["<tool_call>"], 0] = 5.0  # after any ordinary token: open a call
        transitions = [*(("<tool_call>", body) for body in call_bodies),
                       *((body, "</tool_call>") for body in call_bodies),
                       ("</tool_response>", ANSWERS[0]), ("</tool_response>", ANSWERS[1])]
        for before, after in transitions:
            head[ids[after], own[before]] = 10.0
        head[ids[ANSWERS[1]], own["</tool_response>"]] -= second_answer_margin
        for answer in ANSWERS:
            head[eos, own[answer]] = 10.0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_task")
    model_dir, train_file = build_tiny_task(root)
    (root / "answer42.py").write_text(REWARD)
    return build_bigram_policy(model_dir, root / "bigram"), train_file, root


@pytest.mark.slow
def test_grpo_train_runs_calculator_rollouts_and_trains_on_policy_tokens_only(task, tmp_path):
    model_dir, train_file, root = task
    run_dir = tmp_path / "run"
    overrides = [
        f"model.hf_config={model_dir}", f"model.init_from={model_dir}", f"data.train_file={train_file}", f"trainer.run_dir={run_dir}",
        "algorithm.rollout_batch_size=2", "algorithm.num_return_sequences_in_group=4",
        "algorithm.response_length=16", "algorithm.dynamic_sampling=false", "trainer.total_steps=2",
        "trainer.eval_every=0", "trainer.dump_rollouts=true", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "parallel.device=cpu", "parallel.tensor=1", "rollout.engine=hf",
        "reward.function=answer42.py:reward", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_turns=3",
    ]
    runner = RUNNER.format(tests=str(Path(__file__).parent), root=str(root))
    done = subprocess.run([sys.executable, "-c", runner, "train", "--config", str(CONFIG), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["num_turns/min"] == row["num_turns/max"] == 2  # call, tool turn, answer: every rollout
        assert row["tools/calls_per_rollout"] == 1 and row["tools/error_fraction"] == 0
        assert row["tools/void_turn_fraction"] == 0 and row["tools/max_turns_fraction"] == 0
        assert 0 < row["tools/output_token_fraction"] < 1
        assert 0 < row["perf/tool_fraction"] < 1 and row["timing_s/tools"] > 0
        assert "actor/pg_loss" in row
        # the sampler's and the trainer's log-probs agree on the policy's tokens; a tool token (rollout log-prob
        # 0, trainer's ~ -70 under this policy) in the comparison would show as a difference of tens
        assert row["rollout/logprob_diff_max"] < 1e-3
    dumped = [json.loads(line) for line in (run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert len(dumped) == 8
    for line in dumped:
        call, answer = line["turns"]
        assert call["ended"] == "tool_call" and call["calls"][0]["name"] == "calculator"
        assert answer["ended"] == "answer" and call["tool_end"] == answer["start"]
        assert line["response_mask"] == [1] * call["end"] + [0] * (call["tool_end"] - call["end"]) + \
            [1] * (answer["end"] - answer["start"])
        assert "<tool_response>42</tool_response>" in line["response"]
        assert line["reward"] == float(line["response"].endswith("The answer is 42."))
    assert {line["reward"] for line in dumped} == {0.0, 1.0}
