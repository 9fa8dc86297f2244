"""What the fork server of ``grpo_mega.run.launcher.spawn_local_ranks`` imports once, before it forks the ranks: the
heavy libraries every rank needs (torch, megatron-core, transformers), imported under the filters of the libraries'
known harmless warnings (``grpo_mega.run.library_warnings``: they are printed at import, which the ranks no longer do).
Importing this module has those effects; nothing else imports it."""

from grpo_mega.run.library_warnings import quiet_libraries

quiet_libraries()

import megatron.core  # noqa: E402
import torch  # noqa: E402, F401
import transformers  # noqa: E402, F401

__all__ = ["megatron", "torch", "transformers"]
