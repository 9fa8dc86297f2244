"""One job, two worlds: training ranks and rollout ranks (``rollout.mode: async``).

The launcher starts ``T + R`` processes as one job (torchrun, srun). :func:`split_roles` makes the first ``T``
global ranks the training world and the last ``R`` the rollout world, before either creates a process group: each
world is an ordinary torch.distributed world of its own (megatron's model-parallel groups, vLLM's
``external_launcher``, the gathers of generation and scoring all see only their own world), made over one
rendezvous store under its own prefix. ``RANK`` and ``WORLD_SIZE`` are rewritten to the role's rank and size, so
that everything that reads the launcher's environment sees its own world; ``LOCAL_RANK`` is kept, since it picks
the process's GPU. Global rank 0 of the training world and global rank ``T`` (the rollout world's rank 0) are
joined by a third, two-rank group, the *bridge*, over which batches and weights cross
(``grpo_mega.rollout.bridge``).

Global rank 0 is always a training rank: under srun it hosts the rendezvous store, which must live as long as the
job, and the training ranks are the ones that save, log and decide when the job ends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from grpo_mega.parallel.launch_env import read_launch_env

TRAIN, ROLLOUT = "train", "rollout"
ROLE_ENV = "GRPO_MEGA_ROLE"
"""Set to the role in a process of a split job (for logs and the user)."""
GLOBAL_RANK_ENV = "GRPO_MEGA_GLOBAL_RANK"
"""The job-wide rank of a process of a split job (``RANK`` becomes the world's own): failure reports name it."""


@dataclass(frozen=True)
class RoleLayout:
    """Where a global rank lands in a job of ``train_ranks`` training and ``rollout_ranks`` rollout processes."""

    role: str
    """``train`` or ``rollout``."""
    rank: int
    """Rank within the role's world."""
    world_size: int
    """Size of the role's world."""
    global_rank: int
    train_ranks: int
    rollout_ranks: int

    @property
    def on_bridge(self) -> bool:
        """Whether this rank is one of the bridge's two ends (rank 0 of either world)."""
        return self.rank == 0

    @property
    def bridge_rank(self) -> int:
        """This rank's rank in the bridge group: 0 for the trainer's end, 1 for the rollout end."""
        return 0 if self.role == TRAIN else 1


def role_layout(global_rank: int, world_size: int, rollout_ranks: int) -> RoleLayout:
    """The role of ``global_rank`` when the last ``rollout_ranks`` of ``world_size`` processes generate (a pure
    function). ValueError when that leaves no training rank or no rollout rank."""
    if not 1 <= rollout_ranks < world_size:
        raise ValueError(
            f"rollout.async_ranks={rollout_ranks} must be at least 1 and leave a training rank in a job of "
            f"{world_size} processes: start async_ranks + (the training ranks) processes, e.g. --nproc "
            f"{rollout_ranks + 1} for one training rank"
        )
    if not 0 <= global_rank < world_size:
        raise ValueError(f"rank {global_rank} is outside a job of {world_size} processes")
    train_ranks = world_size - rollout_ranks
    if global_rank < train_ranks:
        return RoleLayout(TRAIN, global_rank, train_ranks, global_rank, train_ranks, rollout_ranks)
    return RoleLayout(ROLLOUT, global_rank - train_ranks, rollout_ranks, global_rank, train_ranks, rollout_ranks)


@dataclass
class RoleSplit:
    """This process's role, and the rendezvous store its worlds and the bridge are made over."""

    layout: RoleLayout
    store: dist.Store
    timeout: timedelta

    def world_store(self) -> dist.Store:
        """The store of this process's own world (a prefix of the job's)."""
        return dist.PrefixStore(f"grpo_mega/{self.layout.role}/", self.store)

    def bridge_group(self) -> dist.ProcessGroup:
        """The two-rank gloo group joining rank 0 of the training world and rank 0 of the rollout world; only
        those two ranks call this. Gloo on every device: what crosses is staged in host memory."""
        if not self.layout.on_bridge:
            raise ValueError(f"only rank 0 of each world is on the bridge, not {self.layout}")
        return dist.ProcessGroupGloo(dist.PrefixStore("grpo_mega/bridge/", self.store), self.layout.bridge_rank, 2,
                                     self.timeout)


_split: RoleSplit | None = None


def split_roles(rollout_ranks: int, *, timeout_s: float) -> RoleSplit:
    """Join the job's rendezvous store and take this process's role (module docstring); rewrites ``RANK`` and
    ``WORLD_SIZE`` to the role's world. ``init_distributed`` then builds the role's world over the store. Call once
    per process, before ``init_distributed``."""
    global _split
    if _split is not None:
        raise ValueError("split_roles was already called in this process")
    env = read_launch_env()
    layout = role_layout(env.rank, env.world_size, rollout_ranks)
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous(f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                                       world_size=env.world_size, timeout=timeout))
    os.environ.update({"RANK": str(layout.rank), "WORLD_SIZE": str(layout.world_size), ROLE_ENV: layout.role,
                       GLOBAL_RANK_ENV: str(env.rank),
                       "MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port),
                       "LOCAL_RANK": str(env.local_rank)})
    _split = RoleSplit(layout, store, timeout)
    return _split


def current_split() -> RoleSplit | None:
    """The split of this process (:func:`split_roles`), or None in an ordinary job."""
    return _split


def forget_split() -> None:
    """Drop the split at the end of a process's distributed life (``destroy_distributed``)."""
    global _split
    _split = None
