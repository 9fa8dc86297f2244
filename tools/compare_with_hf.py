"""Compare a megatron-core checkpoint with its Hugging Face original on the same tokens.

Runs the megatron model at --tp/--pp (fp32, megatron's own pipeline schedule) and the HF model
(transformers, fp32) on the same input ids, then prints the largest absolute logit difference, the
cosine similarity of the logit vectors and how often the greedy next token agrees. Exits with
status 1 when the largest difference exceeds --atol.

    python tools/compare_with_hf.py --hf Qwen2.5-0.5B/ --ckpt ckpt/qwen0.5b --tp 2 --atol 1e-3

Tokens: --text (tokenized with the checkpoint's tokenizer) or random ids (--batch x --seq-len,
--seed). The tool starts tp*pp local processes itself; under torchrun / srun start exactly tp*pp.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _launch import fail, run_job

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
    parser.add_argument("--atol", type=float, default=1e-4,
                        help="largest tolerated |logit difference| (default 1e-4, for fp32)")
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

    hf_config, _ = read_checkpoint_info(args.ckpt)
    if not (args.hf / "config.json").is_file():
        raise ValueError(f"--hf {args.hf}: no config.json")
    original = AutoConfig.from_pretrained(args.hf)
    for field in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers"):
        if getattr(original, field) != getattr(hf_config, field):
            raise ValueError(f"--hf and --ckpt differ in {field}: {getattr(original, field)} vs "
                             f"{getattr(hf_config, field)}")
    gpt_config_from_hf(hf_config, tp=args.tp, pp=args.pp, dtype=torch.float32)
    return input_ids(args, args.ckpt / HF_FILES_DIR, hf_config.vocab_size)


def compare(hf_dir: Path, ckpt: Path, tp: int, pp: int, ids: torch.Tensor) -> dict | None:
    """One rank's part: megatron logits on every rank; rank 0 also runs HF and compares."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from grpo_mega.checkpoint import compare_logits, load_mcore_checkpoint, mcore_logits, read_checkpoint_info
    from grpo_mega.model import build_gpt_model, gpt_config_from_hf
    from grpo_mega.parallel import init_distributed

    init_distributed(tp, pp, seed=0)
    hf_config, _ = read_checkpoint_info(ckpt)
    gpt_config = gpt_config_from_hf(hf_config, tp=tp, pp=pp, dtype=torch.float32,
                                    overrides={"perform_initialization": False})
    model = build_gpt_model(gpt_config)
    load_mcore_checkpoint(model, ckpt)
    logits = mcore_logits(model, ids).cpu()
    if dist.get_rank() != 0:
        return None
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(ids).logits
    return {**compare_logits(expected, logits), "positions": ids.numel()}


def report(result: dict, atol: float) -> tuple[list[str], bool]:
    """The lines to print for a comparison result, and whether it passes (max |diff| <= atol)."""
    passed = result["max_abs_diff"] <= atol
    lines = [
        f"max |logit diff|      {result['max_abs_diff']:.3e}",
        f"cosine similarity     min {result['min_cosine']:.8f}  mean {result['mean_cosine']:.8f}",
        f"next-token agreement  {100 * result['next_token_agreement']:.2f}% of {result['positions']} positions",
        f"PASS (atol {atol:.1e})" if passed
        else f"FAIL: max |logit diff| {result['max_abs_diff']:.3e} > atol {atol:.1e}",
    ]
    return lines, passed


def main(argv=None) -> None:
    """Entry point: run both models, print the differences, exit 1 past --atol."""
    args = parse_args(argv)
    try:
        ids = preflight(args)
    except ValueError as error:
        fail(TOOL, error)
    result = run_job(compare, args.tp * args.pp, args.hf, args.ckpt, args.tp, args.pp, ids)
    if result is None:
        return
    lines, passed = report(result, args.atol)
    print("\n".join(lines))
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
