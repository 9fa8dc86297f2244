"""What the checksums of complete.json add to a checkpoint save (issue 61, part 2), on 7B-shaped shards on this
machine's disk.

    .venv/bin/python bench/checkpoint_checksum.py [--layers 2] [--repeats 3] [--tp-of-shapes 8] [--dir DIR] \\
        [--out bench/results/checkpoint_checksum.json]

Two gloo ranks save through the real save path (``CheckpointManager.save``: dist_checkpointing's torch_dist
writer, the per-rank checksums of the files each rank wrote, rank 0's of the rest, publication, pruning to
``keep_last=1``), alternately with checksums and without (the checksum functions replaced by no-ops), ``--repeats``
times each. Each rank holds what one rank of a Qwen2.5-7B job at TP=8 holds of ``--layers`` transformer layers
(hidden 3584, 28 query / 4 KV heads of 128, MLP 18944): the bf16 weights and, as the optimizer's state, fp32 master
weights and the two Adam moments of them (7B in full, at TP=8, is 28 such layers and the embedding: about 12 GB a
rank; the checksum's share of the save does not depend on the count). Reported: the median save seconds each way,
the seconds spent checksumming (timed inside the saves that do it), and both as a fraction of the save without.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 3584, 28, 4, 128, 18944
"""Qwen2.5-7B's shapes."""


def layer_shapes(tp: int) -> dict[str, tuple[int, int]]:
    """One transformer layer's weight shards on one rank of a TP=``tp`` job (megatron's layout)."""
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {"linear_qkv": (qkv // tp, HIDDEN), "linear_proj": (HIDDEN, HEADS * HEAD_DIM // tp),
            "linear_fc1": (2 * MLP // tp, HIDDEN), "linear_fc2": (HIDDEN, MLP // tp)}


class ShapedEngine:
    """The part of a training engine ``CheckpointManager.save`` reads, holding 7B-shaped shards (random values:
    the bytes on disk are what cost, not what they mean)."""

    engine_name = "megatron"
    distributed_optimizer = False
    steps_done = 1

    def __init__(self, layers: int, tp_of_shapes: int, rank: int, world: int):
        import torch

        self.param_dtype = torch.bfloat16
        self.rank, self.world = rank, world
        generator = torch.Generator().manual_seed(rank)
        self.weights = {f"decoder.layers.{layer}.{name}.weight": torch.randn(shape, generator=generator)
                        for layer in range(layers) for name, shape in layer_shapes(tp_of_shapes).items()}
        self.bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in self.weights.items()}
        self.moments = {name: (tensor * 1e-3, tensor.square() * 1e-6) for name, tensor in self.weights.items()}

    def _sharded(self, key: str, tensor):
        from megatron.core.dist_checkpointing import ShardedTensor

        return ShardedTensor.from_rank_offsets(key, tensor, (0, self.rank, self.world), replica_id=0)

    def model_sharded_state_dict(self) -> dict:
        return {name: self._sharded(name, tensor) for name, tensor in self.bf16.items()}

    def optimizer_sharded_state_dict(self, model, is_loading: bool) -> dict:
        state = {}
        for name, master in self.weights.items():
            exp_avg, exp_avg_sq = self.moments[name]
            state[f"fp32_param.{name}"] = self._sharded(f"optimizer.state.fp32_param.{name}", master)
            state[f"exp_avg.{name}"] = self._sharded(f"optimizer.state.exp_avg.{name}", exp_avg)
            state[f"exp_avg_sq.{name}"] = self._sharded(f"optimizer.state.exp_avg_sq.{name}", exp_avg_sq)
        return {"state": state}

    def schedule_state_dict(self) -> dict:
        return {"num_steps": 1, "max_lr": 1e-6}


def _timed(function, clock: list[float]):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - start
    return timed


def _rank_job(folder: str, layers: int, tp_of_shapes: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    import grpo_mega.checkpoint.training as training
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.parallel import init_distributed

    init_distributed(2, 1, seed=0, device="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = ShapedEngine(layers, tp_of_shapes, rank, world)
    manager = CheckpointManager(folder, keep_last=1)
    real = {"checksums_of": training.checksums_of, "file_checksum": training.file_checksum}
    clock = [0.0]
    timed = {name: _timed(function, clock) for name, function in real.items()}
    off = {"checksums_of": lambda staging, names: {}, "file_checksum": lambda path: "-"}
    rows, step = [], 0
    for repeat in range(repeats):
        for mode in ("with", "without") if repeat % 2 == 0 else ("without", "with"):
            for name, function in (timed if mode == "with" else off).items():
                setattr(training, name, function)
            step += 1
            clock[0] = 0.0
            dist.barrier()
            start = time.perf_counter()
            saved = manager.save(engine, step, extra_state={"position": step}, config={"bench": True})
            seconds = torch.tensor([time.perf_counter() - start, clock[0]], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the save takes as long as its slowest rank
            rows.append({"mode": mode, "save_s": seconds[0].item(), "checksum_s": seconds[1].item(),
                         "bytes": sum(file.stat().st_size for file in saved.rglob("*") if file.is_file())})
    for name, function in real.items():
        setattr(training, name, function)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="saves with checksums, and as many without")
    parser.add_argument("--tp-of-shapes", type=int, default=8, help="the TP whose per-rank shard shapes are saved")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder under the repo, "
                        "on the repository's disk)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "checkpoint_checksum.json"))
    args = parser.parse_args(argv)
    from grpo_mega.run.launcher import spawn_local_ranks

    with tempfile.TemporaryDirectory(prefix="checksum_bench_", dir=args.dir or REPO) as folder:
        rows = spawn_local_ranks(_rank_job, 2, (folder, args.layers, args.tp_of_shapes, args.repeats),
                                 threads=1)[0]
    without = statistics.median(row["save_s"] for row in rows if row["mode"] == "without")
    with_ = statistics.median(row["save_s"] for row in rows if row["mode"] == "with")
    checksum = statistics.median(row["checksum_s"] for row in rows if row["mode"] == "with")
    result = {
        "what": "CheckpointManager.save on 2 gloo ranks, each with one TP=8 rank's shards of Qwen2.5-7B layers "
                "(bf16 weights, fp32 master + Adam moments), with and without complete.json's checksums",
        "command": "python bench/checkpoint_checksum.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "layers": args.layers, "tp_of_shapes": args.tp_of_shapes, "repeats": args.repeats,
        "checkpoint_gib": round(rows[0]["bytes"] / 2**30, 3),
        "save_s_without_checksums": round(without, 3), "save_s_with_checksums": round(with_, 3),
        "checksum_s": round(checksum, 3),
        "checksum_share_of_save": round(checksum / without, 4),
        "save_difference_share": round((with_ - without) / without, 4),
        "rows": rows,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_1min": round(os.getloadavg()[0], 2)},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"checkpoint {result['checkpoint_gib']} GiB: save {without:.2f} s without checksums, {with_:.2f} s with; "
          f"checksumming {checksum:.2f} s = {100 * checksum / without:.1f} % of the save "
          f"(difference of the medians: {100 * (with_ - without) / without:+.1f} %)")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
