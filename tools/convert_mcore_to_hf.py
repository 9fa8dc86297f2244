"""Convert a megatron-core checkpoint back into a Hugging Face folder: one written by convert_hf_to_mcore, or a
training checkpoint of `grpo-mega sft` / `grpo-mega train` (a checkpoint folder, or a run directory for its newest
complete checkpoint; the architecture and tokenizer come from the run's model.hf_config folder).
A classifier PRM (architectures ["Qwen2ForProcessRewardModel"]) is written with its step classifier score.*
and keeps that config; a grpo-mega PRM checkpoint of either layout converts the same way.

A checkpoint of a LoRA run (``model.lora``: adapters only) is written merged, its base (the run's model.init_from)
with W + (alpha / rank) B A in every adapted linear. With --peft-adapter it is written instead as a PEFT adapter
folder (adapter_config.json + adapter_model.safetensors, Hugging Face's module names q_proj ... down_proj, TP shards
gathered; a few MB) that peft.PeftModel.from_pretrained(base, OUT) loads onto the HF base model; a LoRA checkpoint of
engine: deepspeed (peft's adapters already) is written the same way, merged or as an adapter folder.

Reads the checkpoint at --tp/--pp (any layout: dist_checkpointing reshards, whatever layout it was
saved at) and writes safetensors shards, config.json and the tokenizer files, loadable with
transformers.AutoModelForCausalLM.from_pretrained(OUT). Weights are gathered one tensor at a time
(TP all-gather, PP broadcast) and written shard by shard, so rank 0 holds at most one shard extra.

    python tools/convert_mcore_to_hf.py --ckpt ckpt/qwen0.5b --out qwen0.5b-hf [--tp 2 --pp 1]
    python tools/convert_mcore_to_hf.py --ckpt runs/lora/checkpoints/step_000100 --out lora-adapter --peft-adapter

The tool starts tp*pp local processes itself; under torchrun / srun start exactly tp*pp.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _launch import fail, run_job

TOOL = "convert_mcore_to_hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog=TOOL, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", required=True, type=Path,
                        help="checkpoint folder from convert_hf_to_mcore, or a training checkpoint / run directory")
    parser.add_argument("--out", required=True, type=Path, help="new or empty output folder")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel processes (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel processes (default 1)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="dtype written; auto = the dtype the checkpoint stores")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="largest safetensors file, in GiB (default 5, as save_pretrained)")
    parser.add_argument("--peft-adapter", action="store_true",
                        help="a LoRA run's checkpoint: write its adapters as a PEFT adapter folder (adapter_config.json"
                             " + adapter_model.safetensors) instead of merged weights")
    return parser.parse_args(argv)


def read_source(ckpt: Path) -> tuple[object, Path, str, bool]:
    """(HF config, folder of its config/tokenizer files, stored parameter dtype, is a training checkpoint)."""
    from grpo_mega.checkpoint import read_checkpoint_info
    from grpo_mega.checkpoint.source import resolve_model_source
    from grpo_mega.checkpoint.training_files import read_checkpoint_state

    source = resolve_model_source(ckpt)
    if not source.is_checkpoint:
        hf_config, info = read_checkpoint_info(ckpt)
        return hf_config, source.hf_config_folder, info["dtype"], False
    if source.hf_config is None:
        hf_dir = source.model_settings.get("hf_config")
        raise ValueError(f"{ckpt}: the run's model.hf_config ({hf_dir!r}) has no config.json to describe the model")
    dtype = read_checkpoint_state(source.folder).get("param_dtype", "float32")
    return source.hf_config, source.hf_config_folder, dtype, True


def preflight(args: argparse.Namespace) -> object:
    """Check the inputs without starting processes; return the HF config."""
    from grpo_mega.checkpoint import architecture_for
    from grpo_mega.model import gpt_config_from_hf
    from grpo_mega.model.config_map import tools_expert_parallel

    if args.out.exists() and any(args.out.iterdir()):
        raise ValueError(f"--out {args.out} is not empty; choose a new folder")
    if args.max_shard_gb <= 0:
        raise ValueError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    hf_config, _, _, is_training = read_source(args.ckpt)
    architecture_for(hf_config)
    if args.peft_adapter:
        from grpo_mega.checkpoint.source import locate_checkpoint
        from grpo_mega.checkpoint.training_files import lora_settings

        if not is_training or lora_settings(locate_checkpoint(args.ckpt)) is None:
            raise ValueError(f"--peft-adapter: {args.ckpt} is not a checkpoint of a LoRA run (model.lora.rank > 0); "
                             "export it without --peft-adapter")
        if not architecture_for(hf_config).lm_output:
            raise ValueError(f"--peft-adapter: {args.ckpt} is a classifier PRM (its score head is no PEFT target); "
                             "export it merged, without --peft-adapter")
    gpt_config_from_hf(hf_config, tp=args.tp, pp=args.pp, dtype=torch.float32,
                       ep=tools_expert_parallel(hf_config, args.tp))
    return hf_config


def export(ckpt: Path, out: Path, tp: int, pp: int, dtype_name: str, max_shard_bytes: int,
           peft_adapter: bool = False) -> dict:
    """One rank's part: load its stage, take part in every gather; rank 0 writes the files."""
    import torch.distributed as dist

    from grpo_mega.checkpoint import SafetensorsShardWriter, copy_side_files
    from grpo_mega.model.config_map import tools_expert_parallel
    from grpo_mega.parallel import init_distributed
    from prm.export import write_megatron_weights, write_peft_adapter_folder

    start = time.perf_counter()
    hf_config, side_files, stored_name, is_training = read_source(ckpt)
    init_distributed(tp, pp, seed=0, ep=tools_expert_parallel(hf_config, tp))
    stored = getattr(torch, stored_name)
    out_dtype = stored if dtype_name == "auto" else DTYPES[dtype_name]
    if peft_adapter:
        files = write_peft_adapter_folder(ckpt, hf_config, out if dist.get_rank() == 0 else None,
                                          stored_dtype=stored_name, out_dtype=out_dtype)
        if not files:
            return {}
        copy_side_files(side_files, out)  # the tokenizer files; no config.json: the folder is no model of its own
        for name in ("config.json", "generation_config.json"):  # (transformers would look for its weights)
            (out / name).unlink(missing_ok=True)
        return {"seconds": time.perf_counter() - start, "files": len(files),
                "bytes": sum(path.stat().st_size for path in files), "dtype": str(out_dtype)[6:]}
    writer = SafetensorsShardWriter(out, max_shard_bytes) if dist.get_rank() == 0 else None
    # the model is built in the stored dtype (float32 for anything else) so loading is exact
    write_megatron_weights(ckpt, hf_config, training_checkpoint=is_training, stored_dtype=stored_name, writer=writer,
                           out_dtype=out_dtype)
    if writer is None:
        return {}
    files = writer.close()
    copy_side_files(side_files, out)
    if out_dtype != stored:
        hf_config.dtype = out_dtype
        hf_config.save_pretrained(out)
    return {"seconds": time.perf_counter() - start, "files": len(files),
            "bytes": writer.total_bytes, "dtype": str(out_dtype)[6:]}


def _deepspeed_folder(ckpt: Path) -> Path | None:
    """The checkpoint folder when ``ckpt`` is (or a run directory's newest is) a DeepSpeed-engine checkpoint."""
    from grpo_mega.checkpoint.source import resolve_model_source

    source = resolve_model_source(ckpt)
    return source.folder if source.saved_by == "deepspeed" else None


def _export_deepspeed(args: argparse.Namespace, hf_config) -> None:
    """A checkpoint of ``engine: deepspeed``: its ZeRO partitions merged in this process (DeepSpeed's zero_to_fp32)."""
    from grpo_mega.engine.deepspeed_checkpoint import export_weights_to_hf
    from grpo_mega.engine.source_weights import deepspeed_checkpoint_weights

    start = time.perf_counter()
    _, side_files, _, _ = read_source(args.ckpt)
    dtype = torch.float32 if args.dtype == "auto" else DTYPES[args.dtype]
    if args.peft_adapter:  # a LoRA run of engine: deepspeed holds peft's tensors already
        from grpo_mega.checkpoint import copy_side_files
        from grpo_mega.engine.deepspeed_checkpoint import export_deepspeed_lora_adapter

        export_deepspeed_lora_adapter(_deepspeed_folder(args.ckpt), args.out, dtype=dtype)
        copy_side_files(side_files, args.out)  # the tokenizer files; no config.json: the folder is no model
        for name in ("config.json", "generation_config.json"):
            (args.out / name).unlink(missing_ok=True)
        print(f"{TOOL}: wrote {args.out} (PEFT adapter of a DeepSpeed checkpoint) in {time.perf_counter() - start:.1f} s")
        return
    export_weights_to_hf(deepspeed_checkpoint_weights(_deepspeed_folder(args.ckpt)), args.out, hf_config,
                         side_files_from=side_files, dtype=dtype)
    print(f"{TOOL}: wrote {args.out} (DeepSpeed checkpoint, {str(dtype)[6:]}) in {time.perf_counter() - start:.1f} s")


def main(argv=None) -> None:
    """Entry point: validate, then export on tp*pp ranks."""
    args = parse_args(argv)
    try:
        hf_config = preflight(args)
    except ValueError as error:
        fail(TOOL, error)
    if _deepspeed_folder(args.ckpt) is not None:
        return _export_deepspeed(args, hf_config)
    max_shard_bytes = int(args.max_shard_gb * 1024**3)
    result = run_job(export, args.tp * args.pp, args.ckpt, args.out, args.tp, args.pp, args.dtype,
                     max_shard_bytes, args.peft_adapter)
    if result:
        from grpo_mega.checkpoint import architecture_for

        what = "PEFT adapter of " if args.peft_adapter else ""
        print(f"{TOOL}: wrote {args.out} ({what}{architecture_for(hf_config).label}, {result['dtype']}, "
              f"{result['bytes'] / 1024**2:.1f} MiB in {result['files']} file(s)) "
              f"in {result['seconds']:.1f} s")


if __name__ == "__main__":
    main()
