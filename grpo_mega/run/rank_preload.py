"""What the fork server of ``grpo_mega.run.launcher.spawn_local_ranks`` imports once, before it forks the ranks: the
heavy libraries every rank needs (torch, megatron-core, transformers), imported under the filters of the libraries'
known harmless warnings (``grpo_mega.run.library_warnings``: they are printed at import, which the ranks no longer do).
First of all, a server started by a launcher ties its life to the launcher's (``grpo_mega.run.lifeline``): its
preload takes 5-50 s, and a launcher may leave meanwhile. Importing this module has those effects; nothing else
imports it."""

from grpo_mega.run.lifeline import arm_fork_server

arm_fork_server()

from grpo_mega.run.interrupts import pause_point  # noqa: E402
from grpo_mega.run.library_warnings import quiet_libraries  # noqa: E402

pause_point("fork_server.preload")  # tests: a Ctrl-C or a SIGKILL to the launcher while its server preloads
quiet_libraries()

import megatron.core  # noqa: E402
import torch  # noqa: E402, F401
import transformers  # noqa: E402, F401

__all__ = ["megatron", "torch", "transformers"]
