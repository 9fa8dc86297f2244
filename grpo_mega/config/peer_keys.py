"""verl's config keys and TRL's ``GRPOConfig`` fields mapped to grpo-mega's keys: the one table behind the unknown-key
message a verl or TRL habit gets (``actor_rollout_ref.rollout.n=8`` -> "in grpo-mega:
algorithm.num_return_sequences_in_group") and behind docs/migrating.md's tables, which ``tests/test_migrating_doc.py``
checks against it row by row (the docs add notes; the mapping itself lives here only).

Each entry: the peer's key -> (grpo-mega's keys, a short note). No keys: grpo-mega has no such setting, and the note
says what takes its place."""

from __future__ import annotations

VERL_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "data.train_files": (("data.train_file",), ""),
    "data.val_files": (("data.eval_file",), ""),
    "data.prompt_key": (("data.prompt_field",), ""),
    "data.reward_fn_key": ((), "reward.function=verl_default reads the data_source column"),
    "data.max_prompt_length": (("data.prompt_length",), ""),
    "data.max_response_length": (("algorithm.response_length",), ""),
    "data.train_batch_size": (("algorithm.rollout_batch_size",), "prompts per step"),
    "actor_rollout_ref.rollout.n": (("algorithm.num_return_sequences_in_group",), "G"),
    "actor_rollout_ref.rollout.name": (("rollout.engine",), ""),
    "actor_rollout_ref.rollout.temperature": (("rollout.temperature",), ""),
    "actor_rollout_ref.rollout.top_p": (("rollout.top_p",), ""),
    "actor_rollout_ref.rollout.top_k": (("rollout.top_k",), "top_k off: verl -1, grpo-mega 0"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": (("trainer.eval_temperature",), ""),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (("rollout.gpu_memory_utilization",), ""),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (("rollout.tensor_parallel",), ""),
    "algorithm.adv_estimator": ((), "grpo-mega trains GRPO; algorithm.supervision=process for step rewards"),
    "algorithm.norm_adv_by_std_in_grpo": (("algorithm.scale_by_std",), ""),
    "actor_rollout_ref.actor.clip_ratio": (("algorithm.clip_low", "algorithm.clip_high"), "set both"),
    "actor_rollout_ref.actor.clip_ratio_low": (("algorithm.clip_low",), ""),
    "actor_rollout_ref.actor.clip_ratio_high": (("algorithm.clip_high",), ""),
    "actor_rollout_ref.actor.clip_ratio_c": (("algorithm.dual_clip_loss",), ""),
    "actor_rollout_ref.model.lora_rank": (("model.lora.rank",), ""),
    "actor_rollout_ref.model.lora_alpha": (("model.lora.alpha",), ""),
    "actor_rollout_ref.model.target_modules": (("model.lora.target_modules",), "megatron's names: linear_qkv, "
                                               "linear_proj, linear_fc1, linear_fc2"),
    "actor_rollout_ref.actor.use_kl_loss": (("algorithm.use_kl_loss",), ""),
    "actor_rollout_ref.actor.kl_loss_coef": (("algorithm.kl_loss_coef",), ""),
    "actor_rollout_ref.actor.kl_loss_type": (("algorithm.kl_estimator",), "low_var_kl is k3, kl is k1, mse is k2"),
    "algorithm.use_kl_in_reward": ((), "no KL in the reward: use the KL loss, algorithm.use_kl_loss=true"),
    "actor_rollout_ref.actor.loss_agg_mode": (("algorithm.loss_agg_mode",), ""),
    "actor_rollout_ref.actor.entropy_coeff": (("algorithm.entropy_coef",), ""),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (("algorithm.mini_batch_size",), ""),
    "actor_rollout_ref.actor.ppo_epochs": (("algorithm.ppo_epochs",), ""),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (("parallel.max_tokens_per_micro_batch",), ""),
    "actor_rollout_ref.actor.optim.lr": (("optim.lr",), ""),
    "actor_rollout_ref.actor.optim.weight_decay": (("optim.weight_decay",), ""),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": (("optim.warmup_steps",), ""),
    "actor_rollout_ref.actor.optim.clip_grad": (("optim.clip_grad",), ""),
    "actor_rollout_ref.actor.grad_clip": (("optim.clip_grad",), ""),
    "actor_rollout_ref.model.path": (("model.hf_config", "model.init_from"), "the architecture's folder, and the "
                                     "weights"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": (("parallel.recompute",), ""),
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": (("parallel.tensor",), ""),
    "custom_reward_function.path": (("reward.function",), "reward.function=PATH:NAME"),
    "custom_reward_function.name": (("reward.function",), "reward.function=PATH:NAME"),
    "reward_model.overlong_buffer.len": (("algorithm.overlong_buffer",), ""),
    "reward_model.overlong_buffer.penalty_factor": (("algorithm.overlong_penalty",), ""),
    "algorithm.filter_groups.enable": (("algorithm.dynamic_sampling",), ""),
    "algorithm.filter_groups.max_num_gen_batches": (("algorithm.max_sampling_rounds",), ""),
    "algorithm.rollout_correction.rollout_is": (("algorithm.rollout_is",), "algorithm.rollout_is=tis"),
    "algorithm.rollout_correction.rollout_is_threshold": (("algorithm.rollout_is_cap",), ""),
    "trainer.total_training_steps": (("trainer.total_steps",), ""),
    "trainer.save_freq": (("trainer.save_every",), ""),
    "trainer.test_freq": (("trainer.eval_every",), ""),
    "trainer.default_local_dir": (("trainer.run_dir",), ""),
    "trainer.resume_mode": (("trainer.resume",), ""),
    "trainer.logger": (("trainer.loggers",), ""),
    "trainer.project_name": (("trainer.wandb_project",), ""),
    "trainer.val_only": ((), "the command `grpo-mega eval --config c.yaml --policy PATH`"),
    "trainer.n_gpus_per_node": ((), "--nproc N (or SLURM)"),
    "trainer.nnodes": ((), "--nproc N per node (or SLURM)"),
    "trainer.total_epochs": (("trainer.total_steps",), "no epochs: steps"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": (("algorithm.policy_loss",), "vanilla is ppo, geo_mean is "
                                                      "gmpo; gspo, cispo as they are"),
    "actor_rollout_ref.rollout.multi_turn.enable": (("rollout.multi_turn.enable",), ""),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": (("rollout.multi_turn.max_turns",), ""),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": ((), "no simulated user: the turns after the prompt are "
                                                             "tool turns"),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": (("rollout.multi_turn.max_tool_response_tokens",),
                                                                      ""),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": (
        ("rollout.multi_turn.tool_response_truncate_side",), ""),
    "actor_rollout_ref.rollout.multi_turn.format": (("rollout.multi_turn.format",), ""),
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": ((), "one call per assistant turn"),
    "actor_rollout_ref.rollout.multi_turn.function_tool_path": (("rollout.multi_turn.tools",), "a tool spec "
                                                                 "path/to/file.py:function"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": (("rollout.multi_turn.tools",), "a tool spec "
                                                               "path/to/file.py:function"),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": ((), "always token in, token out"),
}
"""verl's keys (its ``ppo_trainer.yaml`` / ``ppo_megatron_trainer.yaml``) -> grpo-mega's."""

TRL_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "reward_funcs": (("reward.function", "reward.functions"), ""),
    "reward_weights": (("reward.weights",), ""),
    "num_generations": (("algorithm.num_return_sequences_in_group",), ""),
    "max_completion_length": (("algorithm.response_length",), ""),
    "max_prompt_length": (("data.prompt_length",), ""),
    "per_device_train_batch_size": (("algorithm.rollout_batch_size", "algorithm.mini_batch_size"), ""),
    "gradient_accumulation_steps": (("algorithm.rollout_batch_size", "algorithm.mini_batch_size"), ""),
    "generation_batch_size": (("algorithm.rollout_batch_size", "algorithm.mini_batch_size"), ""),
    "num_iterations": (("algorithm.ppo_epochs",), ""),
    "learning_rate": (("optim.lr",), ""),
    "lr_scheduler_type": (("optim.decay_style",), ""),
    "warmup_steps": (("optim.warmup_steps",), ""),
    "weight_decay": (("optim.weight_decay",), ""),
    "max_grad_norm": (("optim.clip_grad",), ""),
    "beta": (("algorithm.use_kl_loss", "algorithm.kl_loss_coef"), ""),
    "epsilon": (("algorithm.clip_low",), ""),
    "epsilon_high": (("algorithm.clip_high",), ""),
    "delta": (("algorithm.dual_clip_loss",), ""),
    "loss_type": (("algorithm.loss_agg_mode",), ""),
    "scale_rewards": (("algorithm.scale_by_std",), ""),
    "temperature": (("rollout.temperature",), ""),
    "top_p": (("rollout.top_p",), ""),
    "top_k": (("rollout.top_k",), ""),
    "use_vllm": (("rollout.engine",), "rollout.engine=vllm"),
    "vllm_gpu_memory_utilization": (("rollout.gpu_memory_utilization",), ""),
    "vllm_tensor_parallel_size": (("rollout.tensor_parallel",), ""),
    "vllm_importance_sampling_correction": (("algorithm.rollout_is",), "algorithm.rollout_is=tis"),
    "entropy_coef": (("algorithm.entropy_coef",), ""),
    "max_steps": (("trainer.total_steps",), ""),
    "save_steps": (("trainer.save_every",), ""),
    "eval_steps": (("trainer.eval_every",), ""),
    "output_dir": (("trainer.run_dir",), ""),
    "report_to": (("trainer.loggers",), ""),
    "seed": (("parallel.seed",), ""),
    "peft_config": (("model.lora.rank", "model.lora.alpha", "model.lora.dropout", "model.lora.target_modules"),
                    "peft's r, lora_alpha, lora_dropout, target_modules"),
    "importance_sampling_level": (("algorithm.policy_loss",), "sequence is gspo, token is ppo"),
    "tools": (("rollout.multi_turn.enable", "rollout.multi_turn.tools"), "each function as path/to/file.py:function"),
    "max_tool_calling_iterations": (("rollout.multi_turn.max_turns",), "N iterations are N + 1 turns"),
}
"""TRL's ``GRPOConfig`` fields (and the trainer's ``reward_funcs``) -> grpo-mega's."""


def peer_key_hint(key: str, known: set[str]) -> str:
    """``" (verl's); in grpo-mega: algorithm.num_return_sequences_in_group (G)"`` for a verl or TRL key ``key``
    whose grpo-mega keys are all in ``known`` (the schema's dotted keys: an SFT config gets no GRPO key), else
    ``""``."""
    for peer, table in (("verl", VERL_KEYS), ("TRL", TRL_KEYS)):
        if key not in table:
            continue
        ours, note = table[key]
        if any(name not in known for name in ours):
            return ""
        if not ours:
            return f" ({peer}'s); grpo-mega has no such setting: {note}"
        return f" ({peer}'s); in grpo-mega: {' and '.join(ours)}{f' ({note})' if note else ''}"
    return ""
