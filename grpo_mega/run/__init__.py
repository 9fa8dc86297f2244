"""A run's life below the engines: the plumbing every command shares, none of it torch at import.

It holds starting the processes of a job (``launcher``: reuse torchrun's or srun's, relaunch under torchrun, fork
local ranks; ``rank_preload``: what the fork server imports once), the run folder's names (``layout``: folders,
files, step names), the metrics log (``metrics``), stop requests and the exit status of a stopped run
(``control``), the failure record ``failure.json`` and the phase a rank is in (``failure``), the watchdog of bounded
phases (``watchdog``), ending a rank's helper processes with it (``reaper``), running a grpo-mega command as a child
process with its progress (``commands``, the pipelines' runner) and the known harmless warnings of the libraries
(``library_warnings``). It may import the standard library, ``grpo_mega.perf`` and, lazily inside a function that
runs in a rank, ``grpo_mega.parallel``; ``checkpoint/``, ``rollout/``, the harness and every command import it,
never the other way.
"""
