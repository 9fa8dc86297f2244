"""``grpo-mega quickstart --regime tools``: the synthetic task that needs its tool (issue 75, part 5), from nothing
to its two SFT policies.

data (``grpo_mega.data.tool_task``: multi-digit chains, each row in two surface forms) + a tokenizer trained on both
forms -> the tiny Qwen2-shaped policy's config -> text-only SFT on the worked solutions and tool SFT on the
calculator demonstrations (``data.segments_field``: tool turns encoded on their own and masked out of the loss),
the same steps, seed and problems -> the text-only policy's sampled pass@1 on held-out prompts (``grpo-mega
eval``, temperature 1) -> the GRPO arms' sparse start (``grpo_mega.quickstart.tool_selection``: the tool checkpoint
nearest 20 % sampled pass@1 through the turn loop, the text one of the same step) -> ``summary.json``, whose path is
the last line printed. ``bench/pipeline_seeds.py --regime tools --sft-run RUN_DIR`` runs the GRPO arms from there.

The tool policy's accuracy needs the calculator during generation: ``bench/tool_regime_sft.py`` measures both
policies through the multi-turn turn loop (``rollout.multi_turn`` with ``tools: [calculator]``;
bench/results/tool_regime_sft.json).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpo_mega.data.synthetic import Difficulty
from grpo_mega.data.tool_task import SEGMENTS_FIELD, TOOL_DIFFICULTY

SFT_ARMS = ("tool", "text")
"""The two SFT runs: on the text-only worked solutions, and on the tool demonstrations."""


@dataclass(frozen=True)
class ToolRegimePlan:
    """Sizes of the tool regime (the defaults: the measured run of bench/results/tool_regime_sft.json)."""

    name: str = "tools"
    num_train: int = 3000
    num_heldout: int = 300
    difficulty: Difficulty = field(default_factory=lambda: TOOL_DIFFICULTY)
    vocab_size: int = 400
    """Enough merges that the hermes call's JSON boilerplate is a few tokens (``"calculator"`` is one)."""
    sft_steps: int = 400
    """Steps of each SFT (batch 64, configs/quickstart_sft.yaml's optimiser: warm-up, cosine to 10 %)."""
    more_sft_steps: int = 600
    """Then this many more steps of each SFT from its weights (``model.init_from``: a fresh optimiser, warm-up and
    cosine), in ``sft_<arm>_more``; 0: none. The measured recipe: after 400 steps neither policy copies a
    multi-digit number (both 0 % held-out); the copying appears within the next 200 steps."""
    max_length: int = 256
    """SFT's ``data.max_length`` and the policy's context: a three-step tool demonstration is ~150 tokens."""
    response_length: int = 80
    """Tokens the text-only policy may write in ``grpo-mega eval`` (a three-step worked solution is <= 67 with
    its end token)."""
    eval_prompts: int = 300
    eval_samples: int = 1
    """Evaluations at temperature 1 (seeds ``seed + k``) averaged into the text-only policy's sampled pass@1."""
    save_every: int = 25
    """The "more" SFTs keep a checkpoint every this many steps: the candidates of the sparse start."""
    sparse_pass_at_1: float | None = 0.20
    """The GRPO arms' tool policy: the checkpoint whose sampled pass@1 through the turn loop is closest to this
    (``grpo_mega.quickstart.tool_selection``; issue 76's sparse start); None: no selection."""
    selection_steps: tuple[int, int] = (200, 400)
    """The "more" SFT steps whose checkpoints are candidates (600 - 800 steps in all: where the tool policy's
    pass@1 climbs from 3 % to 82 %)."""
    selection_prompts: int = 300
    """Training prompts each candidate is measured on (at temperature 1)."""
    selection_samples: int = 1
    tool_response_length: int = 200
    """Tokens of a tool rollout, tool output included (a three-call conversation is ~150; at 120 the SFT policy's
    pass@1 fell from 89.7 % to 30 %); the text-only arm gets the same budget."""
    prompt_length: int = 48
    """``data.prompt_length`` of the tool task's rollouts (its prompts are <= 30 tokens)."""
    seed: int = 1234


TOOLS = ToolRegimePlan()
FAST_TOOLS = ToolRegimePlan(num_train=300, num_heldout=16, sft_steps=6, more_sft_steps=2, eval_prompts=16,
                            save_every=1, selection_steps=(1, 2), selection_prompts=16, tool_response_length=160)
"""A shortened run (``--fast``): every command of the regime, a few steps each."""


def build_tool_data_and_model(run_dir: Path, plan: ToolRegimePlan) -> tuple[Path, Path, Path]:
    """Write the tool task, its tokenizer and the policy's HF config folder; returns (model, train, heldout).
    ValueError when a demonstration does not fit ``plan.max_length``."""
    from transformers import Qwen2Config

    from grpo_mega.data.tokenizer import load_tokenizer
    from grpo_mega.data.tool_task import build_tool_task, check_segments, encode_segments
    from grpo_mega.quickstart.plans import POLICY_SHAPE

    files = build_tool_task(run_dir / "data", num_train=plan.num_train, num_heldout=plan.num_heldout, seed=0,
                            difficulty=plan.difficulty, vocab_size=plan.vocab_size)
    tokenizer = load_tokenizer(files.tokenizer)
    longest = 0
    for line in files.train.read_text().splitlines():
        row = json.loads(line)
        response, _ = encode_segments(tokenizer, check_segments(row[SEGMENTS_FIELD], where="train"), 0)
        longest = max(longest, len(tokenizer.encode(row["prompt"])) + len(response))
    if longest > plan.max_length:
        raise ValueError(f"ToolRegimePlan: a tool demonstration is {longest} tokens, more than max_length="
                         f"{plan.max_length}")
    model_dir = run_dir / "model"
    # Twice the longest sequence: the hf engine refuses a turn-loop call whose longest prefix plus the largest row's
    # budget passes max_position_embeddings, so with no room to spare a later turn is split into many small calls
    # (2026-12-07, 32 x 8 rollouts per step: 7.2 / 7.3 / 6.3 s of generation per step at 512 on an idle machine; the
    # runs at 256 were on a loaded one, 148 s and 240 s, so not a clean comparison). Positions past max_length are
    # never trained.
    config = Qwen2Config(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **{**POLICY_SHAPE, "max_position_embeddings": 2 * plan.max_length},
    )
    config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir, files.train, files.heldout


def sft_overrides(arm: str, plan: ToolRegimePlan) -> list[str]:
    """configs/quickstart_sft.yaml's overrides of one SFT arm beyond the task's paths."""
    if arm not in SFT_ARMS:
        raise ValueError(f"tool regime: unknown SFT arm {arm!r}; known: {SFT_ARMS}")
    return [f"data.max_length={plan.max_length}", *([f"data.segments_field={SEGMENTS_FIELD}"] if arm == "tool" else [])]


def more_sft_saves(plan: ToolRegimePlan) -> list[str]:
    """The "more" SFTs' checkpoint settings: one every ``plan.save_every`` steps, all kept (the sparse start's
    candidates); ValueError when the selection's steps are not among them."""
    first, last = plan.selection_steps
    if plan.sparse_pass_at_1 is not None and not (
            0 < first <= last <= plan.more_sft_steps and first % plan.save_every == 0):
        raise ValueError(f"ToolRegimePlan.selection_steps={plan.selection_steps}: must be saved steps (multiples of "
                         f"save_every={plan.save_every}) within the {plan.more_sft_steps} more SFT steps")
    return [f"trainer.save_every={plan.save_every}", f"trainer.keep_last={plan.more_sft_steps // plan.save_every + 1}"]


def selects_sparse_start(plan: ToolRegimePlan) -> bool:
    return plan.sparse_pass_at_1 is not None and plan.more_sft_steps > 0


def run_tool_regime(run_dir: str | Path, plan: ToolRegimePlan = TOOLS) -> dict:
    """Every part of ``plan`` under ``run_dir``; writes and returns ``summary.json``'s content."""
    from grpo_mega.quickstart.arm_runs import NPROC, training_command
    from grpo_mega.quickstart.selection import measure_pass_at_1

    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    started, seconds = time.perf_counter(), {}
    total = 2 + len(SFT_ARMS) * (2 if plan.more_sft_steps else 1) + selects_sparse_start(plan)
    header = iter(range(1, total + 1))

    def announce(text: str) -> None:
        print(f"[{next(header)}/{total}] {text}", flush=True)

    announce(f"tool task (two surface forms), tokenizer and model config -> {run_dir}")
    begin = time.perf_counter()
    model_dir, train_file, heldout_file = build_tool_data_and_model(run_dir, plan)
    seconds["data"] = time.perf_counter() - begin
    task = [f"model.hf_config={model_dir}", f"data.train_file={train_file}", f"parallel.seed={plan.seed}"]
    checkpoints = {}
    for arm in SFT_ARMS:
        announce(f"SFT on the {arm} demonstrations (DP=2 on 2 processes), log: {run_dir / f'sft_{arm}.log'}")
        seconds[f"sft_{arm}"] = training_command(
            f"SFT ({arm})", ["sft"], "quickstart_sft.yaml", run_dir / f"sft_{arm}", plan.sft_steps,
            (("nll", "sft/nll"),), [*task, *sft_overrides(arm, plan)], run_dir / f"sft_{arm}.log")
        checkpoints[arm] = run_dir / f"sft_{arm}"
        if plan.more_sft_steps:
            more = run_dir / f"sft_{arm}_more"
            announce(f"{plan.more_sft_steps} more SFT steps on the {arm} demonstrations from step {plan.sft_steps}'s "
                     f"weights, log: {more}.log")
            seconds[f"sft_{arm}_more"] = training_command(
                f"SFT ({arm}, more)", ["sft"], "quickstart_sft.yaml", more, plan.more_sft_steps,
                (("nll", "sft/nll"),), [*task, *sft_overrides(arm, plan), f"model.init_from={checkpoints[arm]}",
                                        *more_sft_saves(plan)],
                Path(f"{more}.log"))
            checkpoints[arm] = more
    announce(f"the text-only SFT policy's sampled pass@1 on {plan.eval_prompts} held-out prompts, log: "
             f"{run_dir / 'eval_text.log'}")
    begin = time.perf_counter()
    text_pass_at_1 = measure_pass_at_1(
        checkpoints["text"], task=task, prompts_file=heldout_file, prompts=plan.eval_prompts,
        samples=plan.eval_samples, response_length=plan.response_length, out=run_dir / "eval_text.json",
        nproc=NPROC)
    seconds["eval_text"] = time.perf_counter() - begin
    sparse = None
    if selects_sparse_start(plan):
        from grpo_mega.quickstart.tool_selection import select_sparse_start

        announce(f"the GRPO arms' sparse start: the tool checkpoint closest to {plan.sparse_pass_at_1:g} sampled "
                 f"pass@1 through the turn loop, logs: {run_dir / 'sparse_selection'}/")
        begin = time.perf_counter()
        sparse = select_sparse_start(run_dir, plan, tool_sft=checkpoints["tool"], text_sft=checkpoints["text"],
                                     task=task, train_file=train_file, nproc=NPROC)
        seconds["sparse_selection"] = time.perf_counter() - begin
    summary = {
        "regime": plan.name,
        "text_sft_pass_at_1": text_pass_at_1,
        "tool_sft_pass_at_1": None,
        "tool_sft_pass_at_1_note": "needs the calculator during generation: bench/tool_regime_sft.py measures it "
                                   "through the multi-turn turn loop (rollout.multi_turn, tools [calculator])",
        "sft_checkpoints": {arm: str(path) for arm, path in checkpoints.items()},
        "sparse_start": sparse,
        "model": str(model_dir), "train_file": str(train_file), "heldout_file": str(heldout_file),
        "plan": {**asdict(plan), "difficulty": asdict(plan.difficulty)},
        "wall_seconds": round(time.perf_counter() - started, 1),
        "stage_seconds": {key: round(value, 1) for key, value in seconds.items()},
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_tool_summary(summary: dict) -> None:
    """The regime's figures, one per line."""
    print(f"tool regime: text-only SFT sampled pass@1 {summary['text_sft_pass_at_1']:.3f} on held-out prompts; "
          f"the tool SFT policy: {summary['tool_sft_pass_at_1_note']}", flush=True)
    sparse = summary.get("sparse_start")
    if sparse:
        tool = sparse["tool_pass_at_1"][str(sparse["more_sft_step"])]["pass_at_1"]
        print(f"sparse start (GRPO arms): after {sparse['total_sft_steps']} SFT steps, the tool policy {tool:.3f} and "
              f"the text-only policy {sparse['text_pass_at_1']['pass_at_1']:.3f} sampled pass@1 on "
              f"{sparse['prompts']} training prompts ({sparse['tool_checkpoint']}, {sparse['text_checkpoint']})",
              flush=True)
