"""The benchmark workload through TRL's ``GRPOTrainer`` (one process), timed per optimizer step.

Same settings as our run: the workload's HF folder (weights and tokenizer), its prompts, G completions of up to
``--max-new`` tokens at temperature ``--temperature`` (full vocabulary: top_k 0, top_p 1), no KL (beta 0), one
optimizer step per generated batch (``num_iterations=1``, ``steps_per_generation`` = the accumulation steps, so
TRL computes no extra old-log-prob pass), token-mean loss (``dapo``), constant lr, clip 1.0, fp32 on the CPU.
The batch is trained in micro-batches of ``--micro-batch`` completions (gradient accumulation) so the activations
fit in memory. Phases: ``gen`` is ``_generate_and_score_completions`` (generation, reward, advantages); the rest
of the optimizer step is ``update``.

    python bench/trl_grpo.py --model DIR --prompts FILE --num-prompts 64 --group 8 --max-new 64 --steps 3 --out X
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import digit_reward, load_prompts  # noqa: E402


def run_trl(model_dir: Path, prompts: list[str], *, group: int, max_new: int, steps: int, temperature: float,
            lr: float, micro_batch: int, seed: int = 0) -> dict:
    """Train ``steps`` optimizer steps; per-step wall seconds, generation seconds and completion token counts."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    completions_per_step = len(prompts) * group
    if completions_per_step % micro_batch:
        raise ValueError(f"--micro-batch {micro_batch} must divide prompts x group = {completions_per_step}")
    accumulation = completions_per_step // micro_batch
    records: list[dict] = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            records[-1]["gen"] += time.perf_counter() - start
            records[-1]["response_tokens"] += int(output["completion_mask"].sum())
            records[-1]["tokens"] += int(output["completion_mask"].sum() + output["prompt_mask"].sum())
            return output

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            records.append({"gen": 0.0, "response_tokens": 0, "tokens": 0, "start": time.perf_counter()})

        def on_step_end(self, args, state, control, **kwargs):
            records[-1]["step"] = time.perf_counter() - records[-1].pop("start")

    def reward(prompts, completions, **kwargs):
        return [digit_reward(p, c, "") for p, c in zip(prompts, completions)]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"), per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, steps_per_generation=accumulation, num_generations=group,
        max_completion_length=max_new, temperature=temperature, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        loss_type="dapo", scale_rewards="group", learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, fp16=False, seed=seed, disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
    dataset = Dataset.from_dict({"prompt": list(prompts)})
    trainer = Timed(model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
                    callbacks=[StepClock()])
    trainer.train()
    for record in records:
        record["update"] = record["step"] - record["gen"]
    return {"steps": records, "threads": torch.get_num_threads(), "trl_version": __import__("trl").__version__,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="jsonl with a 'prompt' field")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    result = run_trl(args.model, load_prompts(args.prompts, args.num_prompts), group=args.group,
                     max_new=args.max_new, steps=args.steps, temperature=args.temperature, lr=args.lr,
                     micro_batch=args.micro_batch)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
