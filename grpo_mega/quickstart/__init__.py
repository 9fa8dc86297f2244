"""The CPU quickstart (``grpo-mega quickstart``, ``make demo``): a light orchestrator that runs grpo-mega's own
commands as child processes and reads what they leave on disk.

It holds ``pipeline`` (the stages: data, SFT, the PRM, the GRPO arms, the summary), ``selection`` (the sparse
regime's SFT checkpoint picked by measured pass@1), ``report`` (each arm's figures read from its metrics log) and
``plots`` (the accuracy curves). It may import ``run`` (the command runner, the run folder's names, the metrics
log), ``data`` (the synthetic task and its tokenizer) and the PRM pipeline; no torch at import, so a quickstart
starts in well under a second. Only the CLI imports it.
"""
