"""The process reward model (PRM): heads, data formats, automatic labels, training, scoring and evaluation.

Modules, one job each:

- ``examples``   the one in-memory form of a PRM example: a prompt, its steps and (when known) their labels
- ``rendering``  the rendering contract shared by label, train, score and eval: prompt + step_1 + tag + ...,
                 and the token index of each tag's last token
- ``data``       readers for Math-Shepherd, PRM800K, stepwise (TRL), ProcessBench and the synthetic task
- ``synthetic``  step truth and planted-error solutions for the synthetic arithmetic task
- ``heads``      the two published head layouts (``classifier`` as Qwen2.5-Math-PRM, ``lm_tokens`` as
                 Math-Shepherd) on the Megatron backbone
- ``model``      PRM specs, engines, loading a grpo-mega PRM checkpoint or an HF PRM folder
- ``metrics``    step accuracy / F1, ProcessBench F1, best-of-N, label agreement (pure functions)
- ``labeling``   Monte-Carlo step labels from a policy's rollout engine (``grpo-mega prm label``)
- ``train``      PRM training on the Megatron engine (``grpo-mega prm train``)
- ``scoring``    ``score_steps`` and ``grpo-mega prm score``
- ``evaluate``   ``grpo-mega prm eval``
"""
