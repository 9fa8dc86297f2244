"""Verifying a training checkpoint's content against the checksums its ``complete.json`` records, collectively:
which files a rank checksums at a save (those it wrote), which it reads at a resume (a share by size), and the
newest checkpoint of a run that verifies (``trainer.resume: auto``). The checksums themselves, and the size check
that comes first, are ``grpo_mega.run.checkpoints``' (no torch: the light processes read them too).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from grpo_mega.checkpoint.collective import is_distributed, is_rank0, rank0_decides
from grpo_mega.run.checkpoints import (
    checksum_mismatch,
    newest_complete,
    read_listing,
    recorded_checksums,
    writer_rank,
)

logger = logging.getLogger("grpo_mega.checkpoint.training")  # the checkpoint manager's log: one place to read


def written_by_this_rank(staging: Path) -> list[str]:
    """The files of the save in ``staging`` this rank wrote, as their names say (dist_checkpointing's data files
    ``__<rank>_<n>.distcp``): it checksums them while they are in its page cache; rank 0 checksums the rest."""
    rank = dist.get_rank() if is_distributed() else 0
    names = (file.relative_to(staging).as_posix() for file in staging.rglob("*") if file.is_file())
    return [name for name in names if writer_rank(name) == rank]


def _shares(sizes: dict[str, int], names: list[str], ranks: int) -> list[list[str]]:
    """``names`` split among ``ranks`` by size: largest first, each to the rank with the fewest bytes so far."""
    shares, load = [[] for _ in range(ranks)], [0] * ranks
    for name in sorted(names, key=lambda name: (-sizes.get(name, 0), name)):
        least = load.index(min(load))
        shares[least].append(name)
        load[least] += sizes.get(name, 0)
    return shares


def content_problem(path: Path) -> str | None:
    """Whether a file of the complete checkpoint ``path`` no longer matches the checksum ``complete.json`` records,
    in one line (file, found, expected); None when all match. Collective: the files are shared among the ranks by
    size and each reads its share, so a resume reads the checkpoint once, all ranks at once. A checkpoint saved
    before checksums passes with a note (its sizes were checked)."""
    recorded, sizes = rank0_decides(lambda: (recorded_checksums(path), read_listing(path)))
    if recorded is None:
        if is_rank0():
            logger.warning("%s records no checksums (saved before they were added): its files were checked by size "
                           "only", path)
        return None
    ranks = dist.get_world_size() if is_distributed() else 1
    mine = _shares(sizes, list(recorded), ranks)[dist.get_rank() if is_distributed() else 0]
    problems = [problem for name in mine if (problem := checksum_mismatch(path, name, recorded[name]))]
    if is_distributed():
        gathered: list[Any] = [None] * ranks
        dist.all_gather_object(gathered, problems)
        problems = [problem for part in gathered for problem in part]
    return min(problems) if problems else None


def newest_verified(run_dir: Path, *, verify: bool = True) -> Path | None:
    """The checkpoint ``trainer.resume: auto`` resumes from; collective: the newest complete one of ``run_dir``
    (``grpo_mega.run.checkpoints.newest_complete``) whose files match their checksums, each altered one refused in
    a warning (file, found, expected) and the fallback said; None when there is none; ValueError when every
    complete one was altered (starting over would hide it and save over them). ``verify=False``: sizes only."""
    refused: list[Path] = []
    while True:
        path = rank0_decides(lambda: newest_complete(run_dir, warn=logger.warning, skip=refused))
        problem = content_problem(path) if path is not None and verify else None
        if problem is None:
            break
        if is_rank0():
            logger.warning("refusing checkpoint %s: %s; looking for an older one", path, problem)
        refused.append(path)
    if refused and path is None:
        raise ValueError(f"no checkpoint of {run_dir} can be resumed: every complete one was altered after its save "
                         f"(the newest: {refused[0].name}); restore them or start a new run")
    if refused and is_rank0():
        logger.warning("resuming from %s, the newest checkpoint whose files match their checksums (refused: %s)",
                       path, ", ".join(p.name for p in refused))
    return path
