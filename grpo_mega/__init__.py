"""grpo-mega: GRPO for large language models on megatron-core (TP / PP / DP).

Outcome-supervised GRPO and process-supervised GRPO (PRM step rewards, suffix-sum advantages).
The pure math lives in :mod:`grpo_mega.algo`.

The top of the package is the programs a user runs: ``cli`` (the ``grpo-mega`` command), ``trainer`` (GRPO),
``sft``, ``rollout_worker`` (the rollout world of ``rollout.mode: async``) and ``eval_command`` (``grpo-mega eval``).
Everything else is a package named for its one concern. Layers, lowest first; a module imports only from its own
layer and the ones below, and there is no import circle (declared and checked in ``tests/test_import_layers.py``):

1. pure code: ``algo`` (the GRPO math), ``perf`` (memory figures, start-up clocks)
2. ``parallel``: process groups, the launch environment
3. ``run``: a run's life below the engines (launching, the run folder's names, the metrics log, stop requests,
   failure records, the watchdog, the reaper, the command runner): no torch at import
4. ``model``, ``data``, ``reward``, ``tools``: the Megatron GPT model, datasets, tokenizers and batch layout, reward
   functions, the tools' sandbox
5. ``checkpoint``: weights on disk (HF conversion, converted folders, training checkpoints)
6. ``engine`` and ``rollout``: the engines that hold a model on the devices (training, forward-only, generation);
   each has a ``factory`` module, the one place that knows every engine
7. what a PRM is, read from disk: ``prm``'s examples, rendering contract and spec
8. ``config``: the typed run config (it checks the layout of the PRM a GRPO config names)
9. the ``prm`` package's library (heads, data, engines, scoring, Monte-Carlo labels, evaluation)
10. ``harness``: a training run's life above the engines (``RunHarness``, and ``resume``: what each trainer's
    checkpoint holds, saved and restored in one place)
11. the trainers and the GRPO step: ``stages`` (the stages of one GRPO step, its loss, held-out evaluation),
    ``trainer``, ``rollout_worker``, ``sft``, and ``prm.train``
12. what a user runs: ``cli``, ``eval_command``, ``quickstart`` (the CPU pipeline), ``plan`` (the memory planner),
    ``prm``'s commands

So grpo_mega and prm import each other one way: prm builds on grpo_mega's infrastructure (layers 1-6), run config
and harness, and grpo_mega's trainers, GRPO step and commands (layers 11-12) build on prm, because
process-supervised GRPO scores steps with a PRM and the planner and the CLIs know its shapes and commands. The
config reaches into prm at one point only, the PRM's spec (layer 7: which layout a path holds, read from disk with
the checkpoint layer alone), to check the PRM a GRPO config names.
"""

__version__ = "0.1.0"
