"""How fast does a tiny Qwen2-shaped policy learn the synthetic task? (SFT, then optionally a short GRPO-style run.)

Plain transformers + torch on CPU, no Megatron: this picks the task difficulty, model shape and budget that the
quickstart uses. It trains a tokenizer, runs SFT on reference solutions (loss on completion tokens only) and every
``--eval-every`` optimizer steps measures held-out accuracy with greedy decoding and with sampling at T=1, next to
the wall-clock and CPU seconds spent training (evaluation excluded). CPU seconds / threads estimates the wall
time on an otherwise idle machine, as the CI machines are shared. With ``--rl-steps`` > 0 it then runs on-policy
group-normalised policy gradient (GRPO with one update per batch, so the ratio is 1 and clipping never acts; no
KL) with the synthetic reward and reports the same accuracies.

    OMP_NUM_THREADS=2 python bench/sft_feasibility.py --out runs/feas.json            # the recipe below
    python bench/sft_feasibility.py --save-model runs/sft400                           # then RL from it:
    python bench/sft_feasibility.py --init-model runs/sft400 --sft-steps 0 --rl-steps 60 --rl-lr 3e-5

Recipe (the defaults), measured 2026-11-22 on the shared 2-core machine with ``--threads 1``:
task ``Difficulty()`` (2 steps, start and operands 2..9, + - *, values <= 99; 3000 train / 200 held-out problems,
~3300 distinct questions exist), byte-level BPE vocabulary of 306, prompt+solution <= 55 tokens; Qwen2 hidden 128,
4 layers, 4 heads / 2 KV heads, intermediate 512, tied embeddings (1.02M parameters); batch 64, AdamW lr 3e-3
(betas 0.9/0.98, no weight decay), 50 warm-up steps, cosine to 10% over 400 steps, grad-norm clip 1.0.
Held-out accuracy after 400 steps: greedy 48%, T=1 sampled 33-36%; after 500 steps (cosine over 500): greedy
58.5%, sampled 48-53%. Accuracy jumps between steps 300 and 500, so the step count, not the wall time, fixes the
result. One SFT step costs 0.38-0.46 CPU-seconds on one thread (more under heavy contention).
(The quickstart has since moved on: 800 SFT steps, 2700 / 500 problems, half of the SFT targets direct answers;
see grpo_mega/quickstart/pipeline.py.)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

from grpo_mega.data.synthetic import Difficulty, Problem, is_correct, make_splits, task_texts
from grpo_mega.data.tokenizer import load_tokenizer, train_tokenizer


def parse_args() -> argparse.Namespace:
    """Command-line settings: task difficulty, model shape, optimisation and time budgets."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    task = p.add_argument_group("task")
    task.add_argument("--min-steps", type=int, default=2)
    task.add_argument("--max-steps", type=int, default=2)
    task.add_argument("--start-range", type=int, nargs=2, default=(2, 9))
    task.add_argument("--operand-range", type=int, nargs=2, default=(2, 9))
    task.add_argument("--operators", default="+-*", help="subset of +-*")
    task.add_argument("--max-value", type=int, default=99)
    task.add_argument("--num-train", type=int, default=3000)
    task.add_argument("--num-heldout", type=int, default=200)
    task.add_argument("--vocab-size", type=int, default=320)
    model = p.add_argument_group("model (Qwen2-shaped, tied embeddings)")
    model.add_argument("--hidden", type=int, default=128)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--intermediate", type=int, default=512)
    sft = p.add_argument_group("SFT")
    sft.add_argument("--batch", type=int, default=64)
    sft.add_argument("--lr", type=float, default=3e-3)
    sft.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    sft.add_argument("--sft-steps", type=int, default=400, help="optimizer steps; lr decays (cosine) to 10%% over them")
    sft.add_argument("--constant-lr", action="store_true", help="no decay after warm-up")
    sft.add_argument("--eval-every", type=int, default=50, help="optimizer steps between evaluations")
    rl = p.add_argument_group("GRPO-style run after SFT")
    rl.add_argument("--rl-steps", type=int, default=0)
    rl.add_argument("--rl-prompts", type=int, default=16, help="prompts per step")
    rl.add_argument("--rl-group", type=int, default=8, help="completions per prompt")
    rl.add_argument("--rl-lr", type=float, default=3e-5)
    rl.add_argument("--rl-warmup", type=int, default=0, help="linear lr warm-up steps")
    rl.add_argument("--rl-positive-only", action="store_true",
                    help="clamp advantages at 0 (rejection-sampling fine-tuning, for comparison with GRPO)")
    rl.add_argument("--rl-eval-every", type=int, default=25, help="RL steps between evaluations")
    p.add_argument("--init-model", type=Path, default=None, help="start from a --save-model folder instead of scratch")
    p.add_argument("--save-model", type=Path, default=None, help="save model and tokenizer here after SFT (HF format)")
    p.add_argument("--eval-samples", type=int, default=4, help="T=1 samples per held-out problem")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args()


def build_model(args: argparse.Namespace, tokenizer, max_positions: int):
    """A Qwen2ForCausalLM built from a local Qwen2Config (no hub), fp32, tied input/output embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM(config).float()


def encode_examples(problems: list[Problem], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids ending with EOS) for every problem's reference solution."""
    return [
        (tokenizer.encode(p.prompt), tokenizer.encode(p.solution, add_special_tokens=False) + [tokenizer.eos_token_id])
        for p in problems
    ]


def sft_batch(examples, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding)."""
    length = max(len(p) + len(c) for p, c in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(examples):
        sequence = prompt + completion
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(prompt) : len(sequence)] = torch.tensor(completion)
        mask[row, : len(sequence)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], sample: bool, max_new_tokens: int) -> tuple[torch.Tensor, int, list[str]]:
    """Left-padded batched generation; returns (prompt+completion ids, prompt width, decoded completions).

    Sampling is pure temperature-1 sampling (top_k=0, top_p=1), the distribution GRPO optimises.
    """
    model.eval()
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    output = model.generate(
        **encoded,
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    width = encoded["input_ids"].shape[1]
    texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    return output, width, texts


def accuracy(model, tokenizer, problems: list[Problem], sample: bool, max_new_tokens: int, chunk: int = 200) -> float:
    """Fraction of completions with the right final answer (pass ``problems`` repeated for several samples each)."""
    right = 0
    for i in range(0, len(problems), chunk):
        part = problems[i : i + chunk]
        _, _, texts = generate(model, tokenizer, [p.prompt for p in part], sample, max_new_tokens)
        right += sum(is_correct(p, t) for p, t in zip(part, texts))
    return right / len(problems)


def evaluate(model, tokenizer, heldout, max_new_tokens, record: dict, samples: int) -> dict:
    """Add greedy and T=1 sampled held-out accuracy (``samples`` per problem) to ``record`` and print it."""
    start = time.perf_counter()
    record["greedy_acc"] = accuracy(model, tokenizer, heldout, False, max_new_tokens)
    record["sampled_acc"] = accuracy(model, tokenizer, [p for p in heldout for _ in range(samples)], True, max_new_tokens)
    record["eval_seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(record), flush=True)
    return record


class TrainingClock:
    """Wall-clock and process CPU seconds spent inside ``with clock:`` blocks (training, not evaluation)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> "TrainingClock":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu

    def fields(self) -> dict:
        """The times for a history record."""
        return {"wall_s": round(self.wall, 1), "cpu_s": round(self.cpu, 1)}


def run_sft(args, model, tokenizer, train, heldout, max_new_tokens, clock: TrainingClock) -> list[dict]:
    """``args.sft_steps`` steps of SFT, evaluating every ``args.eval_every`` steps and at the end."""
    examples = encode_examples(train, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        warm = min(1.0, (step + 1) / args.warmup)
        if args.constant_lr:
            return warm
        progress = min(1.0, step / args.sft_steps)
        return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    rng = random.Random(args.seed)
    history, losses = [], []
    for step in range(1, args.sft_steps + 1):
        with clock:
            model.train()
            batch = sft_batch(rng.sample(examples, args.batch), tokenizer.pad_token_id)
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.sft_steps:
            record = {"phase": "sft", "step": step, **clock.fields(), "loss": round(sum(losses) / len(losses), 4)}
            losses = []
            history.append(evaluate(model, tokenizer, heldout, max_new_tokens, record, args.eval_samples))
    return history


def sequence_logprob_mean(model, ids: torch.Tensor, width: int, completion_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean log-probability of the completion tokens (positions >= width, before and at EOS)."""
    attention = torch.cat([(ids[:, :width] != model.config.pad_token_id).long(), completion_mask], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, width - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, width:, None]).squeeze(-1)
    return (logprobs * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1)


def run_rl(args, model, tokenizer, train, heldout, max_new_tokens, clock: TrainingClock) -> list[dict]:
    """On-policy GRPO-style updates: A_i = (r_i - mean_group) / (std_group + 1e-6), loss = -mean_i A_i * mean_t logp."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, args.rl_warmup)))
    rng = random.Random(args.seed + 1)
    history, rewards_seen = [], []
    for step in range(1, args.rl_steps + 1):
        with clock:
            rewards_seen.append(_rl_step(args, model, tokenizer, optimizer, rng.sample(train, args.rl_prompts), max_new_tokens))
            scheduler.step()
        if step % args.rl_eval_every == 0 or step == args.rl_steps:
            record = {"phase": "rl", "rl_step": step, **clock.fields(),
                      "train_reward": round(sum(rewards_seen) / len(rewards_seen), 3)}
            rewards_seen = []
            history.append(evaluate(model, tokenizer, heldout, max_new_tokens, record, args.eval_samples))
    return history


def _rl_step(args, model, tokenizer, optimizer, problems: list[Problem], max_new_tokens: int) -> float:
    """One on-policy update on ``problems`` x ``args.rl_group`` samples; returns the mean reward."""
    repeated = [p for p in problems for _ in range(args.rl_group)]
    ids, width, texts = generate(model, tokenizer, [p.prompt for p in repeated], True, max_new_tokens)
    rewards = torch.tensor([float(is_correct(p, t)) for p, t in zip(repeated, texts)])
    grouped = rewards.view(len(problems), args.rl_group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
    if args.rl_positive_only:
        advantages = advantages.clamp(min=0)
    completion = ids[:, width:]
    # Tokens up to and including the first EOS belong to the completion; later ones are padding.
    is_eos = (completion == tokenizer.eos_token_id).long()
    mask = ((is_eos.cumsum(1) - is_eos) == 0).long()
    model.train()
    loss = -(advantages * sequence_logprob_mean(model, ids, width, mask)).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return rewards.mean().item()


def main() -> None:
    """Build data and tokenizer, run SFT (and optionally RL), print and save accuracy against training time."""
    args = parse_args()
    torch.set_num_threads(args.threads)
    difficulty = Difficulty(
        min_steps=args.min_steps, max_steps=args.max_steps, start_range=tuple(args.start_range),
        operand_range=tuple(args.operand_range), operators=tuple(args.operators), max_value=args.max_value,
    )
    train, heldout = make_splits(args.num_train, args.num_heldout, seed=args.seed, difficulty=difficulty)
    split = {"seed": args.seed, "num_train": args.num_train, "num_heldout": args.num_heldout, **difficulty.__dict__}
    if args.init_model:
        from transformers import Qwen2ForCausalLM

        saved = json.loads((args.init_model / "split.json").read_text())
        if saved != json.loads(json.dumps(split)):
            # Another split would put some of the model's training questions into the held-out set.
            raise ValueError(f"--init-model {args.init_model} was trained on split {saved}, not {split}")

        tokenizer = load_tokenizer(args.init_model)
        model = Qwen2ForCausalLM.from_pretrained(str(args.init_model)).float()
    else:
        with tempfile.TemporaryDirectory() as folder:
            tokenizer = train_tokenizer(task_texts(train), folder, vocab_size=args.vocab_size)
    longest = max(len(tokenizer.encode(p.prompt + p.solution)) for p in train + heldout)
    max_new_tokens = max(len(tokenizer.encode(p.solution, add_special_tokens=False)) for p in train + heldout) + 8
    if not args.init_model:
        model = build_model(args, tokenizer, max_positions=2 * longest + 16)
    params = sum(t.numel() for t in model.parameters())
    print(json.dumps({"params": params, "vocab": len(tokenizer), "longest_tokens": longest,
                      "train_problems": len(train), "difficulty": difficulty.__dict__}), flush=True)
    clock = TrainingClock()
    history = run_sft(args, model, tokenizer, train, heldout, max_new_tokens, clock) if args.sft_steps > 0 else []
    if args.save_model:
        model.save_pretrained(str(args.save_model))
        tokenizer.save_pretrained(str(args.save_model))
        (args.save_model / "split.json").write_text(json.dumps(split))
    if not history:  # started from --init-model without SFT: measure the starting point
        history.append(evaluate(model, tokenizer, heldout, max_new_tokens, {"phase": "init", **clock.fields()}, args.eval_samples))
    if args.rl_steps > 0:
        history += run_rl(args, model, tokenizer, train, heldout, max_new_tokens, clock)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"settings": settings, "params": params, "history": history}, indent=1))


if __name__ == "__main__":
    main()
