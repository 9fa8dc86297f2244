"""``grpo-mega eval``: a policy's held-out accuracy, the same figure a GRPO run logs as ``eval/accuracy``, for any
policy on disk (an HF folder, a converted megatron folder, a training checkpoint or run directory) and without
training it (verl's ``trainer.val_only``).

The settings come from a GRPO config, so a run's own config evaluates what it would evaluate: ``data.eval_file``
(at most ``data.max_eval_prompts``, with ``data.*``'s fields, template and length), ``reward.function``,
``algorithm.response_length``, ``rollout.stop``, ``trainer.eval_temperature`` (0: greedy) and ``parallel.seed``.
Sample ``k`` of ``--samples K`` draws with seed ``parallel.seed + k``, the seed the trainer's evaluation after step
``k`` uses; at a temperature above 0 the mean over the samples is the sampled pass@1 with its spread. The hf rollout
engine generates (``prm.policy``); with ``--nproc N`` the ranks split the prompts. Rank 0 says on stderr what it
is doing as it goes (``grpo_mega.run.progress.PhaseProgress``: a line per sample, one every 10 s while generating).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def evaluate_policy(cfg, policy: str | Path, *, samples: int = 1) -> dict:
    """The held-out figures of ``policy`` under ``cfg`` (a ``GRPOConfig``); collective (every rank of the job calls
    it, after ``init_distributed``). Returns the report (the same on every rank)."""
    import torch.distributed as dist

    from grpo_mega.run.progress import PhaseProgress
    from grpo_mega.stages.rollout_setup import eval_prompts, run_evaluation, with_turn_loop
    from prm.policy import load_policy_rollout

    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    progress = PhaseProgress("grpo-mega eval", speaks=not dist.is_initialized() or dist.get_rank() == 0)
    progress.start(f"loading the policy {policy}")
    rollout = load_policy_rollout(policy, generation_batch_size=cfg.rollout.generation_batch_size)
    prompts = eval_prompts(cfg, rollout.tokenizer)
    if not prompts:
        raise ValueError(f"data.eval_file={cfg.data.eval_file}: no usable prompt")
    progress.finish(f"loaded ({rollout.weights_format})")
    rollout.engine.on_progress = progress
    engine = with_turn_loop(cfg, rollout.engine, rollout.tokenizer)  # rollout.multi_turn: the policy calls its tools
    runs = []
    try:
        for version in range(samples):
            progress.start(f"sample {version + 1}/{samples}", len(prompts), "prompts to generate and score")
            runs.append(run_evaluation(cfg, engine, prompts, version))
            progress.finish(f"accuracy {runs[-1]['eval/accuracy']:.3f}")
    finally:
        if engine is not rollout.engine:
            engine.toolset.close()
    accuracies = [run["eval/accuracy"] for run in runs]
    return {
        "policy": str(policy), "weights_format": rollout.weights_format, "eval_file": str(cfg.data.eval_file),
        "prompts": len(prompts), "temperature": cfg.trainer.eval_temperature, "samples": samples,
        "seeds": [cfg.parallel.seed + version for version in range(samples)],
        "accuracy_per_sample": accuracies, "accuracy_mean": statistics.fmean(accuracies),
        "accuracy_sd": statistics.stdev(accuracies) if samples > 1 else 0.0,
        "response_length_mean": statistics.fmean(run["eval/response_length"] for run in runs),
        "reward_failures": sum(run["eval/reward_failures"] for run in runs),
    }


def run_eval_command(cfg, policy: str, *, samples: int, out: str | None) -> int:
    """One rank of ``grpo-mega eval``: set up the job, evaluate, print (and write ``out``) on rank 0."""
    import torch.distributed as dist

    from grpo_mega.parallel import destroy_distributed, init_distributed

    init_distributed(cfg.parallel.tensor, 1, seed=cfg.parallel.seed, device=cfg.parallel.device,
                     timeout_s=cfg.trainer.collective_timeout_s, ep=cfg.parallel.expert)
    try:
        report = evaluate_policy(cfg, policy, samples=samples)
        rank = dist.get_rank()
    finally:
        destroy_distributed()
    if rank != 0:  # every rank holds the same report; rank 0 speaks
        return 0
    spread = f" +- {report['accuracy_sd']:.3f}" if samples > 1 else ""
    print(f"grpo-mega eval: {policy}: accuracy {report['accuracy_mean']:.3f}{spread} on {report['prompts']} prompts "
          f"of {report['eval_file']} ({samples} sample(s) at temperature {report['temperature']:g}), mean response "
          f"{report['response_length_mean']:.1f} tokens")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        print(out)
    return 0
