"""grpo-mega: GRPO for large language models on megatron-core (TP / PP / DP).

Outcome-supervised GRPO and process-supervised GRPO (PRM step rewards, suffix-sum advantages).
The pure math lives in :mod:`grpo_mega.algo`.

Layers, lowest first; a module imports only from its own layer and the ones below, and there is no import circle
(declared and checked in ``tests/test_import_layers.py``):

1. pure code: ``algo`` (the GRPO math), ``batch``, ``metrics``, ``plots``, ``perf``, ``run_control``
2. ``parallel`` and ``launcher``: process groups, launch environment, the torchrun relaunch
3. ``model``, ``data``, ``reward``: the Megatron GPT model, datasets and tokenizers, reward functions
4. ``checkpoint``: weights on disk (HF conversion, converted folders, training checkpoints)
5. ``engine`` and ``rollout``: the engines that hold a model on the devices (training, forward-only, generation);
   each has a ``factory`` module, the one place that knows every engine
6. what a PRM is, read from disk: ``prm``'s examples, rendering contract and spec
7. ``config``: the typed run config (it checks the layout of the PRM a GRPO config names)
8. the ``prm`` package's library (heads, data, engines, scoring, Monte-Carlo labels, evaluation)
9. the trainers and the GRPO step: ``stages`` (the stages of one GRPO step), ``grpo_loss``, ``evaluation``,
   ``trainer``, ``sft``, and ``prm.train``
10. what a user runs: ``cli``, ``quickstart``, ``command_runner``, ``plan`` (the memory planner), ``prm``'s commands

So grpo_mega and prm import each other one way: prm builds on grpo_mega's infrastructure (layers 1-5) and run
config (its training config reuses the config's sections), and grpo_mega's trainers, GRPO step and commands (layers
9-10) build on prm, because process-supervised GRPO scores steps with a PRM and the planner and the CLIs know its
shapes and commands. The config reaches into prm at one point only, the PRM's spec (layer 6: which layout a path
holds, read from disk with the checkpoint layer alone), to check the PRM a GRPO config names.
"""

__version__ = "0.1.0"
