"""grpo-mega: GRPO for large language models on megatron-core (TP / PP / DP).

Outcome-supervised GRPO and process-supervised GRPO (PRM step rewards, suffix-sum advantages).
The pure math lives in :mod:`grpo_mega.algo`.

Layers, lowest first; a module imports only from its own layer and the ones below, and there is no import circle
(declared and checked in ``tests/test_import_layers.py``):

1. pure code: ``algo`` (the GRPO math), ``batch``, ``metrics``, ``plots``, ``perf``, ``run_control``
2. ``config``: the typed run config
3. ``parallel`` and ``launcher``: process groups, launch environment, the torchrun relaunch
4. ``model``, ``data``, ``reward``: the Megatron GPT model, datasets and tokenizers, reward functions
5. ``checkpoint``: weights on disk (HF conversion, converted folders, training checkpoints)
6. ``engine`` and ``rollout``: the engines that hold a model on the devices (training, forward-only, generation);
   each has a ``factory`` module, the one place that knows every engine
7. the ``prm`` package's library (heads, data, rendering, scoring, labels), built on the layers above
8. the trainers and the GRPO step: ``stages`` (the stages of one GRPO step), ``grpo_loss``, ``evaluation``,
   ``trainer``, ``sft``, and ``prm.train``
9. what a user runs: ``cli``, ``quickstart``, ``command_runner``, ``plan`` (the memory planner), ``prm``'s commands

grpo_mega and prm therefore import each other only one way per layer: prm's library sits on grpo_mega's
infrastructure (layers 1-6), and grpo_mega's top (layers 8-9) uses prm, because process-supervised GRPO scores
steps with a PRM and the planner and the CLIs know the PRM's shapes and commands.
"""

__version__ = "0.1.0"
