"""Convert a Hugging Face Qwen2 / Llama model folder into a megatron-core checkpoint.

Also a classifier PRM (Qwen2.5-Math-PRM layout: config.json architectures ["Qwen2ForProcessRewardModel"], a
Qwen2 backbone without lm_head and the step classifier score.*), stored with its head on the last stage.

The output loads at ANY tensor/pipeline parallel layout (megatron dist_checkpointing, torch_dist
format, reshards on load); --tp/--pp only choose how the conversion itself is split, i.e. how much
memory each process needs (each one reads only its pipeline stage's tensors from the safetensors).

Processes: the tool starts tp*pp local processes itself (gloo on CPU, NCCL with GPUs), so

    python tools/convert_hf_to_mcore.py --hf Qwen2.5-0.5B/ --out ckpt/qwen0.5b --tp 2

is all a user runs on one machine. Under a launcher, start exactly tp*pp processes:

    torchrun --nproc-per-node 2 tools/convert_hf_to_mcore.py --hf ... --out ... --tp 2

Output folder: the megatron files, hf/ (config.json, tokenizer and generation files of the source)
and grpo_mega_model.json (model type, vocabulary sizes, dtype, the TP/PP used to write it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _launch import fail, run_job

TOOL = "convert_hf_to_mcore"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog=TOOL, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hf", required=True, type=Path, help="HF model folder (config.json + safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="new or empty output folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel processes (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel processes (default 1)")
    parser.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto",
        help="weight dtype stored; auto = the HF config's dtype if float32/bfloat16, else float32",
    )
    return parser.parse_args(argv)


def architecture_label(hf_config) -> str:
    """The model type, with the PRM architecture when the config names one (for the summary line)."""
    from grpo_mega.checkpoint import architecture_for

    return architecture_for(hf_config).label


def resolve_dtype(choice: str, hf_config) -> torch.dtype:
    """The dtype to store: the requested one, or with 'auto' the HF config's (fp16 widens to fp32)."""
    if choice != "auto":
        return DTYPES[choice]
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    declared = getattr(torch, declared) if isinstance(declared, str) else declared
    return declared if declared in DTYPES.values() else torch.float32


def preflight(args: argparse.Namespace):
    """Check everything that can be checked without starting processes; return the HF config."""
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights, architecture_for, check_hf_weights
    from grpo_mega.checkpoint.hf_transforms import read_model_dims
    from grpo_mega.model import gpt_config_from_hf
    from grpo_mega.model.config_map import tools_expert_parallel

    if not (args.hf / "config.json").is_file():
        raise ValueError(f"--hf {args.hf}: no config.json")
    if args.out.exists() and any(args.out.iterdir()):
        raise ValueError(f"--out {args.out} is not empty; choose a new folder")
    hf_config = AutoConfig.from_pretrained(args.hf)
    architecture_for(hf_config)
    gpt_config = gpt_config_from_hf(hf_config, tp=args.tp, pp=args.pp, dtype=torch.float32,
                                    ep=tools_expert_parallel(hf_config, args.tp))
    check_hf_weights(HFWeights(args.hf), hf_config,
                     read_model_dims(hf_config, gpt_config.padded_vocab_size))
    return hf_config


def convert(hf_dir: Path, out_dir: Path, tp: int, pp: int, dtype: torch.dtype) -> dict:
    """One rank's part: build its stage, fill it from the HF files, save collectively."""
    from transformers import AutoConfig

    from grpo_mega.checkpoint import HFWeights, load_hf_weights, save_mcore_checkpoint
    from grpo_mega.model import gpt_config_from_hf
    from grpo_mega.model.config_map import tools_expert_parallel
    from grpo_mega.parallel import init_distributed
    from prm.engines import build_conversion_stage

    start = time.perf_counter()
    hf_config = AutoConfig.from_pretrained(hf_dir)
    ep = tools_expert_parallel(hf_config, tp)
    init_distributed(tp, pp, seed=0, ep=ep)
    # Every parameter is overwritten from the HF files: skip megatron's random initialisation.
    gpt_config = gpt_config_from_hf(hf_config, tp=tp, pp=pp, dtype=dtype, ep=ep,
                                    overrides={"perform_initialization": False})
    model = build_conversion_stage(hf_config, gpt_config)
    load_hf_weights(model, HFWeights(hf_dir), hf_config)
    save_mcore_checkpoint(model, out_dir, hf_dir)
    return {"seconds": time.perf_counter() - start}


def main(argv=None) -> None:
    """Entry point: validate, then convert on tp*pp ranks."""
    args = parse_args(argv)
    try:
        hf_config = preflight(args)
    except ValueError as error:
        fail(TOOL, error)
    dtype = resolve_dtype(args.dtype, hf_config)
    result = run_job(convert, args.tp * args.pp, args.hf, args.out, args.tp, args.pp, dtype)
    if result is not None:
        print(f"{TOOL}: wrote {args.out} ({architecture_label(hf_config)}, {str(dtype)[6:]}, "
              f"tp={args.tp} pp={args.pp}) in {result['seconds']:.1f} s")


if __name__ == "__main__":
    main()
