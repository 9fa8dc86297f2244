"""Suite-wide: the order in which test files are queued for the workers of ``make test``.

``make test`` runs ``pytest -n 2 --dist loadfile``: each worker takes whole files, one after another. pytest-xdist
(>= 3.6) queues the files by their number of tests, most first. In this suite the slowest files have few tests,
each a multi-process run of a minute or more, so that order put them last: the quickstart end to end (2 tests,
~5 min) was the second-to-last file queued and ran alone while the other worker had nothing left. Here the slow
files are queued first, longest first, and every other file after them in collection order: the many short files
then fill in around the long ones and both workers finish at about the same time.
"""

from __future__ import annotations

# Approximate seconds of the slowest files under `make test` (2 cores, measured 2026-12-02 from pytest's junit XML of
# a whole run at bca72dd, before torchrun's ranks came to be forked: grpo_mega/run/forked_ranks.py); only their
# order matters, and a file missing here just runs after them.
SLOW_FILES = {
    "test_prm_vllm_export.py": 316,
    "test_implicit_prm_run.py": 294,
    "test_quickstart_e2e.py": 250,
    "test_chaos.py": 220,
    "test_slurm.py": 219,
    "test_qwen3_moe.py": 195,
    "test_async_rollouts.py": 195,
    "test_prm_commands.py": 185,
    "test_gpu_check.py": 164,
    "test_slurm_two_nodes.py": 162,
    "test_prm_vllm_scorer.py": 124,
    "test_qwen3.py": 118,
    "test_trainer_hardening.py": 108,
    "test_first_hour_config.py": 104,
    "test_sft_preemption.py": 104,
    "test_readme_small_model.py": 92,
    "test_rollout_vllm.py": 90,
    "test_trainer_preemption.py": 84,
    "test_ctrl_c_windows.py": 82,
    "test_hf_conversion.py": 76,
    "test_gpu_install.py": 75,
    "test_faults.py": 72,
    "test_tree_rollout_run.py": 71,
    "test_engine_deepspeed.py": 66,
    "test_run_folder_guard.py": 60,
    "test_routing_replay.py": 54,
    "test_reward_preflight.py": 53,
    "test_sequence_parallel.py": 44,
    "test_data_formats_cli.py": 41,
    "test_eval_command.py": 41,
    "test_rollout_vocab.py": 36,
    "test_plan.py": 32,
    "test_train_console.py": 29,
    "test_grpo_chat_prompts.py": 28,
    "test_prm_replay.py": 26,
    "test_config_overrides.py": 24,
}


def pytest_configure(config):
    # xdist's reordering by test count would undo the order set below (the option exists from xdist 3.6 on).
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # A stable sort: the tests of a file stay together and in order, and files of equal weight keep theirs.
    items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))
