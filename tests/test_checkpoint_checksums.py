"""Content-checked checkpoints (issue 61, part 2): complete.json records a CRC-32 of every file, computed by the
rank that wrote it; a checkpoint whose file was altered after its save (same size: the size check cannot see it) is
refused before any rank loads it, in one line naming the file, the recorded and the found checksum, and ``resume:
auto`` falls back to the newest checkpoint that verifies, saying so. Older checkpoints without checksums still load,
with a note.

One 2-rank job (TP=2, module fixture) saves steps 1 and 2; then, in the same job, it alters a shard of step 2 and
resumes collectively (both ranks share the reading and agree on step 1). The other tests alter copies of that run,
one file kind at a time: model shard, optimizer state, RNG state (byte ranges of the ``.distcp`` shards, located
through dist_checkpointing's metadata), trainer state (``grpo_mega_checkpoint.json``; the common state, ``common.pt``
or its item in a shard: tests/checkpoint_layout.py), config.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from checkpoint_layout import common_state_range, data_ranges
from dist_utils import run_distributed, tiny_qwen2_config

CONFIG = {"parallel": {"tensor": 2, "pipeline": 1}, "trainer": {"total_steps": 2}}


def _save_two_steps_then_resume_altered(run_dir: str) -> dict:
    """Rank job: TP=2, train and save steps 1 and 2; then alter a data shard of step 2 in place and resume."""
    import torch
    import torch.distributed as dist

    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.config import OptimConfig
    from grpo_mega.engine import build_policy_engine
    from grpo_mega.parallel import init_distributed
    from grpo_mega.stages.grpo_loss import GRPOLossSettings, grpo_loss_fn

    init_distributed(2, 1, seed=3, device="cpu")
    engine = build_policy_engine(tiny_qwen2_config(tied=True, num_layers=2), optim=OptimConfig(lr=1e-2),
                                 total_steps=2, max_tokens_per_micro_batch=40)
    manager = CheckpointManager(run_dir, keep_last=2)
    generator = torch.Generator().manual_seed(0)
    for step in (1, 2):
        input_ids = torch.randint(0, 301, (4, 10), generator=generator)
        batch = dict(input_ids=input_ids, attention_mask=torch.ones(4, 10, dtype=torch.long),
                     loss_mask=torch.ones(4, 10, dtype=torch.long), advantages=torch.randn(4, 10, generator=generator))
        logprobs, _ = engine.forward_logprobs(batch)
        batch["old_logprobs"] = logprobs.detach()
        engine.train_step(batch, grpo_loss_fn(GRPOLossSettings()))
        manager.save(engine, step, extra_state={"prompts_consumed": 4 * step}, config=CONFIG)
    step_2 = manager.checkpoints_dir / "step_000002"
    saved = json.loads((step_2 / "complete.json").read_text())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(Path(run_dir), Path(run_dir + "_pristine"))
        _flip_byte(step_2 / "__1_0.distcp", 100)  # a shard rank 1 wrote
    dist.barrier()
    return {"saved": saved, "resumed": str(manager.find_resume("auto"))}


def _flip_byte(file: Path, offset: int) -> None:
    """Change one byte of ``file`` at ``offset``, keeping its size (what a size check cannot see)."""
    with open(file, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("checksums") / "run"
    per_rank = run_distributed(_save_two_steps_then_resume_altered, 2, str(run_dir))
    return {"run_dir": run_dir, "pristine": Path(f"{run_dir}_pristine"), "ranks": per_rank}


def test_every_file_has_the_checksum_of_its_content_and_the_ranks_checksummed_their_own(job):
    from grpo_mega.run.checkpoints import file_checksum

    saved = job["ranks"][0]["saved"]
    step_2 = job["pristine"] / "checkpoints" / "step_000002"
    assert saved["checksum_algorithm"] == "crc32"
    assert set(saved["checksums"]) == set(saved["files"]) and len(saved["files"]) >= 6
    kinds = {"__0_0.distcp", "__1_0.distcp", common_state_range(step_2)[0], "grpo_mega_checkpoint.json", "config.yaml"}
    assert kinds <= set(saved["files"])
    for name, expected in saved["checksums"].items():
        assert file_checksum(step_2 / name) == expected, name


def test_two_ranks_refuse_an_altered_shard_and_resume_from_the_step_before(job):
    resumed = {rank["resumed"] for rank in job["ranks"]}
    assert resumed == {str(job["run_dir"] / "checkpoints" / "step_000001")}


KINDS = {
    "model shard": lambda step: data_ranges(step, "embedding.word_embeddings.weight")[0],
    "optimizer state": lambda step: data_ranges(step, "optimizer.")[0],
    "rng state": lambda step: data_ranges(step, "rng_state")[-1],
    "trainer state": lambda step: ("grpo_mega_checkpoint.json", 0, 1),
    "extra state and schedule": common_state_range,
    "config": lambda step: ("config.yaml", 0, 1),
    "shard metadata": lambda step: (".metadata", 0, (step / ".metadata").stat().st_size),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_same_size_alteration_of_any_file_kind_is_never_loaded(job, tmp_path, kind, caplog):
    from grpo_mega.checkpoint.source import find_checkpoint_folder
    from grpo_mega.checkpoint.training import CheckpointManager
    from grpo_mega.run.checkpoints import checkpoint_problem

    run_dir = tmp_path / "run"
    shutil.copytree(job["pristine"], run_dir)
    step_1, step_2 = (run_dir / "checkpoints" / f"step_00000{step}" for step in (1, 2))
    name, offset, length = KINDS[kind](step_2)
    recorded = json.loads((step_2 / "complete.json").read_text())["checksums"][name]
    _flip_byte(step_2 / name, offset + length // 2)
    assert checkpoint_problem(step_2) is None  # sizes match: only the checksum sees it

    with caplog.at_level(logging.WARNING):
        assert CheckpointManager(run_dir).find_resume("auto") == step_1
    refusal, = [record.getMessage() for record in caplog.records if "refusing checkpoint" in record.getMessage()]
    assert f"{step_2 / name}: crc32 " in refusal and f"complete.json recorded {recorded} at the save" in refusal
    assert any(f"resuming from {step_1}, the newest checkpoint whose files match" in record.getMessage()
               for record in caplog.records)
    with pytest.raises(ValueError, match=f"is refused: {step_2 / name}: crc32 [0-9a-f]{{8}} on disk"):
        CheckpointManager(run_dir).find_resume(str(step_2))
    with pytest.raises(ValueError, match="is refused"):  # model.init_from, a PRM, eval --policy
        find_checkpoint_folder(step_2)
    assert find_checkpoint_folder(run_dir) == step_1


def test_every_checkpoint_altered_is_an_error_not_a_fresh_start(job, tmp_path):
    from grpo_mega.checkpoint.training import CheckpointManager

    run_dir = tmp_path / "run"
    shutil.copytree(job["pristine"], run_dir)
    for step in (1, 2):
        _flip_byte(run_dir / "checkpoints" / f"step_00000{step}" / "__0_0.distcp", 64)
    with pytest.raises(ValueError, match="every complete one was altered after its save"):
        CheckpointManager(run_dir).find_resume("auto")


def test_a_checkpoint_saved_before_checksums_loads_with_a_note(job, tmp_path, caplog):
    from grpo_mega.checkpoint.training import CheckpointManager

    run_dir = tmp_path / "run"
    shutil.copytree(job["pristine"], run_dir)
    step_2 = run_dir / "checkpoints" / "step_000002"
    marker = step_2 / "complete.json"
    complete = json.loads(marker.read_text())
    del complete["checksums"], complete["checksum_algorithm"]
    marker.write_text(json.dumps(complete))
    with caplog.at_level(logging.WARNING):
        assert CheckpointManager(run_dir).find_resume("auto") == step_2
    assert "records no checksums (saved before they were added): its files were checked by size only" in caplog.text
