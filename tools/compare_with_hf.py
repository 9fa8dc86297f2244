"""Compare a megatron-core checkpoint with its Hugging Face original on the same tokens.

Runs the megatron model at --tp/--pp (fp32, megatron's own pipeline schedule) and the HF model
(transformers, fp32) on the same input ids, then prints the largest absolute logit difference, the
cosine similarity of the logit vectors and how often the greedy next token agrees. Exits with
status 1 unless the conversion is right: the largest difference within --atol + --rtol x the
largest |logit| (rounding grows with the logits and the depth), and the same greedy next token at
every position where the top token leads the second by more than that (near-ties may flip).

    python tools/compare_with_hf.py --hf Qwen2.5-0.5B/ --ckpt ckpt/qwen0.5b --tp 2
    python tools/compare_with_hf.py --hf Qwen2.5-0.5B/ --ckpt ckpt/qwen0.5b --tp 2 --rtol 1e-2   # bf16

Tokens: --text (tokenized with the checkpoint's tokenizer) or random ids (--batch x --seq-len,
--seed). The tool starts tp*pp local processes itself; under torchrun / srun start exactly tp*pp.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _launch import fail, run_job

from grpo_mega.checkpoint.hf_compare import DEFAULT_ATOL, DEFAULT_RTOL

TOOL = "compare_with_hf"


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog=TOOL, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf", required=True, type=Path, help="HF model folder")
    parser.add_argument("--ckpt", required=True, type=Path, help="megatron checkpoint folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel processes (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel processes (default 1)")
    parser.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                        help=f"absolute part of the tolerated |logit difference| (default {DEFAULT_ATOL:g})")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                        help=f"relative part, times the largest |reference logit| (default {DEFAULT_RTOL:g}, "
                             "fp32; about 1e-2 for bf16)")
    parser.add_argument("--text", default=None, help="text to run instead of random token ids")
    parser.add_argument("--batch", type=int, default=2, help="random sequences (default 2)")
    parser.add_argument("--seq-len", type=int, default=32, help="random sequence length (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random ids (default 0)")
    return parser.parse_args(argv)


def input_ids(args: argparse.Namespace, ckpt_hf_dir: Path, vocab_size: int) -> torch.Tensor:
    """[B, S] token ids: the tokenized --text, or seeded random ids below vocab_size."""
    if args.text is not None:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # transformers 5 lets config.json's model_type pick the tokenizer class over tokenizer.json
        # (a custom tokenizer beside a qwen2 config becomes a Qwen2Tokenizer with other ids):
        # tokenizer.json, when there is one, is the tokenizer exactly as saved.
        loader = (PreTrainedTokenizerFast if (ckpt_hf_dir / "tokenizer.json").is_file()
                  else AutoTokenizer)
        ids = loader.from_pretrained(ckpt_hf_dir)(args.text, return_tensors="pt").input_ids
        if ids.numel() == 0:
            raise ValueError(f"--text {args.text!r} tokenizes to no tokens")
        return ids
    if args.batch < 1 or args.seq_len < 1:
        raise ValueError(f"--batch and --seq-len must be positive, got {args.batch}, {args.seq_len}")
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab_size, (args.batch, args.seq_len), generator=generator)


def preflight(args: argparse.Namespace) -> torch.Tensor:
    """Check the inputs without starting processes; return the token ids to run."""
    from transformers import AutoConfig

    from grpo_mega.checkpoint import read_checkpoint_info
    from grpo_mega.checkpoint.mcore_checkpoint import HF_FILES_DIR
    from grpo_mega.model import gpt_config_from_hf
    from grpo_mega.model.config_map import tools_expert_parallel

    hf_config, _ = read_checkpoint_info(args.ckpt)
    if not (args.hf / "config.json").is_file():
        raise ValueError(f"--hf {args.hf}: no config.json")
    original = AutoConfig.from_pretrained(args.hf)
    for field in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        if getattr(original, field) != getattr(hf_config, field):
            raise ValueError(f"--hf and --ckpt differ in {field}: {getattr(original, field)} vs "
                             f"{getattr(hf_config, field)}")
    gpt_config_from_hf(hf_config, tp=args.tp, pp=args.pp, dtype=torch.float32,
                       ep=tools_expert_parallel(hf_config, args.tp))
    return input_ids(args, args.ckpt / HF_FILES_DIR, hf_config.vocab_size)


def compare(hf_dir: Path, ckpt: Path, tp: int, pp: int, ids: torch.Tensor, atol: float = DEFAULT_ATOL,
            rtol: float = DEFAULT_RTOL) -> dict | None:
    """One rank's part: megatron logits on every rank; rank 0 also runs HF and judges the conversion."""
    import torch.distributed as dist

    from grpo_mega.checkpoint import load_mcore_checkpoint, mcore_logits, read_checkpoint_info
    from grpo_mega.model import build_gpt_model, gpt_config_from_hf
    from grpo_mega.model.config_map import tools_expert_parallel
    from grpo_mega.parallel import init_distributed

    hf_config, _ = read_checkpoint_info(ckpt)
    ep = tools_expert_parallel(hf_config, tp)
    init_distributed(tp, pp, seed=0, ep=ep)
    gpt_config = gpt_config_from_hf(hf_config, tp=tp, pp=pp, dtype=torch.float32, ep=ep,
                                    overrides={"perform_initialization": False})
    model = build_gpt_model(gpt_config)
    load_mcore_checkpoint(model, ckpt)
    logits = mcore_logits(model, ids).cpu()
    if dist.get_rank() != 0:
        return None
    return judged(hf_logits(hf_dir, ids), logits, atol, rtol)


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """The transformers model's fp32 logits [B, S, V] on ``ids``."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(ids).logits


def judged(expected: torch.Tensor, logits: torch.Tensor, atol: float, rtol: float) -> dict:
    """``judge_conversion`` of the two logit tensors, with the number of positions."""
    from grpo_mega.checkpoint.hf_compare import judge_conversion

    return {**judge_conversion(expected, logits, atol=atol, rtol=rtol), "positions": expected.shape[:-1].numel()}


def report(result: dict) -> tuple[list[str], bool]:
    """The lines to print for a judged comparison (``judged``), and whether it passes."""
    lines = [
        f"max |logit diff|      {result['max_abs_diff']:.3e}  (tolerance {result['tolerance']:.3e}: largest "
        f"|logit| {result['logit_scale']:.3g})",
        f"cosine similarity     min {result['min_cosine']:.8f}  mean {result['mean_cosine']:.8f}",
        f"next-token agreement  {100 * result['next_token_agreement']:.2f}% of {result['positions']} positions "
        f"({100 * result['decisive_agreement']:.2f}% of the {result['decisive_positions']} without a near-tie)",
    ]
    lines += ["PASS"] if result["passed"] else [f"FAIL: {failure}" for failure in result["failures"]]
    return lines, result["passed"]


def main(argv=None) -> None:
    """Entry point: run both models, print the differences, exit 1 unless the conversion is right."""
    args = parse_args(argv)
    try:
        ids = preflight(args)
    except ValueError as error:
        fail(TOOL, error)
    result = run_job(compare, args.tp * args.pp, args.hf, args.ckpt, args.tp, args.pp, ids, args.atol, args.rtol)
    if result is None:
        return
    lines, passed = report(result)
    print("\n".join(lines))
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
