"""The sampler-vs-trainer gap on a mixture-of-experts model, with and without routing replay (issue 48).

A tiny random Qwen3-MoE (8 experts, top-2, 4 layers) samples completions with the hf rollout engine in ``--sampler-
dtype`` (bf16 stands in for a GPU sampler's lower-precision kernels; fp32 is this CPU's default), returning the
experts of every token (``rollout.routing_replay``'s rollout side). The trainer's megatron engine (fp32, one process)
then computes the log-probs of the same completions with its own routing and with the sampler's replayed, and the
report gives, over response tokens: ``|trainer - sampler|`` log-prob mean and max (the metric
``rollout/logprob_diff_*``), and the share of (token, layer) routing decisions where the trainer's own top-k differs
from the sampler's (the trainer's own routing read from transformers' fp32 model, which routes as megatron's fp32
engine does: tests/test_routing_replay.py). Writes ``bench/results/routing_replay.json`` (``--out``).

    .venv/bin/python bench/routing_replay.py --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def build_model(root: Path, seed: int) -> Path:
    """The quickstart's tokenizer with a random Qwen3-MoE of its widths (4 layers, 8 experts of width 64, top-2)."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

    from grpo_mega.quickstart.pipeline import QuickstartPlan, build_data_and_model

    dense_dir, _, _ = build_data_and_model(root / "task", QuickstartPlan(num_train=16, num_heldout=8))
    dense = AutoConfig.from_pretrained(dense_dir).to_dict()
    shape = {key: dense[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings",
                                         "bos_token_id", "eos_token_id", "pad_token_id")}
    config = Qwen3MoeConfig(**shape, num_hidden_layers=4, head_dim=48, rope_theta=10000.0, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                            architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(seed)
    folder = root / "moe"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in dense_dir.iterdir():  # the tokenizer files
        if name.name != "config.json" and name.is_file() and not name.name.endswith(".safetensors"):
            (folder / name.name).write_bytes(name.read_bytes())
    return folder


def measure(model_dir: Path, sampler_dtype: str, seed: int, prompts: int, group: int, tokens: int) -> dict:
    """One seed: sample, then the trainer's log-probs and routing with and without replay (one process)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_mega.checkpoint import HFWeights
    from grpo_mega.config import OptimConfig
    from grpo_mega.data.batch import response_values_to_tokens, routes_to_tokens, sequences_to_batch
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import destroy_model_parallel, init_distributed, init_model_parallel
    from grpo_mega.rollout import SamplingConfig, build_rollout_engine
    from grpo_mega.rollout.hf_routes import routed_experts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampler = build_rollout_engine("hf", model_path=model_dir, tokenizer=tokenizer, dtype=sampler_dtype,
                                   return_routed_experts=True)
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(3, len(tokenizer), (12,), generator=generator).tolist() for _ in range(prompts)]
    completions = sampler.generate(prompt_ids, SamplingConfig(max_new_tokens=tokens, seed=seed, n=group))
    sequences = [c.prompt_ids + c.response_ids for c in completions]
    batch = sequences_to_batch([c.prompt_ids for c in completions], [c.response_ids for c in completions],
                               pad_id=tokenizer.pad_token_id)
    sampled = response_values_to_tokens(batch, [c.response_logprobs for c in completions])
    response = response_values_to_tokens(batch, [[1.0] * len(c.response_ids) for c in completions]).bool()
    routes = routes_to_tokens(batch, [c.routed_experts for c in completions])
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    own = routed_experts(fp32, sequences, pad_token_id=tokenizer.pad_token_id, batch_size=8)
    differs = [(torch.as_tensor(a).long().sort(-1).values != torch.as_tensor(b).long().sort(-1).values).any(-1)
               for a, b in zip(own, (c.routed_experts for c in completions))]
    out = {"routing_decisions_differing": float(torch.cat([d.reshape(-1) for d in differs]).float().mean())}
    init_distributed(1, 1, seed=seed, device="cpu")
    for replay in (False, True):
        destroy_model_parallel()
        init_model_parallel(1, 1, seed=seed)
        policy = build_policy_engine(AutoConfig.from_pretrained(model_dir), optim=OptimConfig(), total_steps=1,
                                     max_tokens_per_micro_batch=4096, routing_replay=replay)
        policy.load_hf_weights(HFWeights(model_dir))
        logprobs, _ = policy.forward_logprobs(dict(batch, routed_experts=routes) if replay else batch)
        diff = (logprobs - sampled).abs()[response]
        out["replay" if replay else "own_routing"] = {"logprob_diff_mean": float(diff.mean()),
                                                      "logprob_diff_max": float(diff.max())}
    out["response_tokens"] = int(response.sum())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--sampler-dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "routing_replay.json")
    args = parser.parse_args()
    from grpo_mega.run.launcher import run_as_the_only_rank

    started = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="routing_replay_") as work:
        for seed in args.seeds:
            model_dir = build_model(Path(work) / f"seed{seed}", seed)
            for dtype in args.sampler_dtype:
                row = run_as_the_only_rank(measure, (model_dir, dtype, seed, args.prompts, args.group, args.tokens))
                runs.append({"seed": seed, "sampler_dtype": dtype, **row})
                print(json.dumps(runs[-1]), flush=True)
    summary = {}
    for dtype in args.sampler_dtype:
        rows = [r for r in runs if r["sampler_dtype"] == dtype]
        summary[dtype] = {
            f"{kind}_{stat}": statistics.fmean(r[kind][stat] for r in rows)
            for kind in ("own_routing", "replay") for stat in ("logprob_diff_mean", "logprob_diff_max")}
        summary[dtype]["routing_decisions_differing"] = statistics.fmean(r["routing_decisions_differing"]
                                                                         for r in rows)
    result = {"command": "bench/routing_replay.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if k != "out"),
              "machine": platform.node(), "processor": platform.processor() or platform.machine(),
              "seconds": round(time.time() - started, 1), "mean_over_seeds": summary, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
