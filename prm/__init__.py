"""The process reward model (PRM): heads, data formats, automatic labels, training, scoring and evaluation.

Which way the imports point: prm builds on grpo_mega's infrastructure (process groups, model, data, rewards,
checkpoints, training and rollout engines), its run config and run harness (``prm.train``), and never imports
grpo_mega's trainers or commands; grpo_mega's top (the GRPO step's ``stages/process_reward.py``, the trainers, the
planner, the CLIs and the quickstart) imports prm.
So the PRM reuses one engine, one checkpoint format and one rollout engine instead of its own, and
process-supervised GRPO reads step rewards from a PRM opened the way ``grpo-mega prm`` opens it. The config reads
only what a PRM is (its examples, rendering and spec, a layer below the config). The layers are declared, and
checked, in ``tests/test_import_layers.py`` (summary in ``grpo_mega/__init__.py``).

Library modules, one job each:

- ``examples``   the one in-memory form of a PRM example: a prompt, its steps and (when known) their labels
- ``rendering``  the rendering contract shared by label, train, score and eval: prompt + step_1 + tag + ...,
                 and the token index of each tag's last token
- ``turn_steps`` turns as steps: where each step of a multi-turn (tool) rollout ends, its text, the stored
                 row's ``turn_steps``; ``turn_rendering`` a PRM's input read from the policy's tokens
- ``data``       readers for Math-Shepherd, PRM800K, stepwise (TRL), ProcessBench and the synthetic task
- ``synthetic``  step truth and planted-error solutions for the synthetic arithmetic task
- ``heads``      the two published head layouts (``classifier`` as Qwen2.5-Math-PRM, ``lm_tokens`` as
                 Math-Shepherd) on the Megatron backbone; ``hf_model`` the same as a Hugging Face model (DeepSpeed)
- ``model``      PRM specs, engines, loading a grpo-mega PRM checkpoint or an HF PRM folder
- ``config``     the PRM training config
- ``metrics``    step accuracy / F1, ProcessBench F1, best-of-N, label agreement (pure functions)
- ``policy``     the policy to sample from: an hf rollout engine with its weights, from any checkpoint format
- ``labeling``   Monte-Carlo step labels from a policy's rollout engine; ``perturb`` error injection;
                 ``turn_labeling`` the same for turn steps through the turn loop (``turn_setup`` its settings)
- ``scoring``    ``StepScorer.score_steps`` and ``grpo-mega prm score``
- ``evaluate``   the report's figures on step-labelled data; ``best_of_n`` reranking a policy's samples

Trainer and commands (the top layer, beside grpo_mega's):

- ``train``          PRM training on the Megatron or DeepSpeed engine (``grpo-mega prm train``)
- ``label_command``  ``grpo-mega prm label``; ``eval_command`` ``grpo-mega prm eval``; ``cli`` the ``prm`` commands
- ``pipeline``       label -> train -> eval as ``grpo-mega prm`` processes; ``iterative`` the PRM refresh of
                     iterative RL (both run by ``grpo-mega quickstart``)
"""
