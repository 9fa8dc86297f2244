"""Suite-wide: the order in which test files are queued for the workers of ``make test``.

``make test`` runs ``pytest -n 2 --dist loadfile``: each worker takes whole files, one after another. pytest-xdist
(>= 3.6) queues the files by their number of tests, most first. In this suite the slowest files have few tests,
each a multi-process run of a minute or more, so that order put them last: the quickstart end to end (2 tests,
~5 min) was the second-to-last file queued and ran alone while the other worker had nothing left. Here the slow
files are queued first, longest first, and every other file after them in collection order: the many short files
then fill in around the long ones and both workers finish at about the same time.
"""

from __future__ import annotations

import os

import pytest

# Approximate seconds of the slowest files under `make test` (2 cores, measured 2026-12-03 from pytest's junit XML of
# a whole run at e2111a6); only their order matters, and a file missing here just runs after them.
SLOW_FILES = {
    "test_prm_vllm_export.py": 150,  # 215 before the module fixture and in-process tools (2026-12-08: -22 % CPU)
    "test_quickstart_e2e.py": 255,
    "test_async_rollouts.py": 170,  # 209 before the SIGTERM-stopped rollout rank ended at once (2026-12-08)
    "test_implicit_prm_run.py": 172,
    "test_chaos.py": 95,  # 144 before the attempts forked from the shared server (2026-12-08: -37 % CPU)
    "test_prm_commands.py": 142,
    "test_slurm.py": 120,  # 141 before the idle scancel and the merged train job went (2026-12-08)
    "test_qwen3_moe.py": 141,
    "test_slurm_two_nodes.py": 100,  # 139 with 6 job starts; 4 since 2026-12-08
    "test_gpu_check.py": 90,  # 126 before the conversion stage ran its tools in-process on the CPU (2026-12-08)
    "test_prm_vllm_scorer.py": 99,
    "test_readme_small_model.py": 92,
    "test_trainer_hardening.py": 85,
    "test_faults.py": 84,
    "test_quickstart_tools_e2e.py": 90,  # with the sparse start's selection: 294 s at load average ~30 (2026-12-07)
    "test_prm_turn_commands.py": 60,  # 114 s at load average ~20 (2026-12-07)
    "test_quickstart_tool_prm_arms.py": 95,  # 190 s at load average ~18, the e2e test 150 of them (2026-12-07)
    "test_quickstart_tool_tree_arm.py": 50,  # 100 s at load average ~15, the e2e test 90 of them (2026-12-07)
    "test_first_hour_config.py": 71,
    "test_qwen3.py": 66,
    "test_trainer_preemption.py": 61,
    "test_no_process_outlives.py": 112,  # 7 starts of a 2-rank command: 112 s at load average ~8 (2026-12-07)
    "test_engine_deepspeed.py": 60,
    "test_deepspeed_lora.py": 70,  # 99 s at load (2026-12-07, 2 benchmarks beside it); estimated idle
    "test_run_folder_guard.py": 52,
    "test_resume_config_changes.py": 50,  # these two: estimated from runs alone (2026-12-07), as the guard's file
    "test_stop_at_once.py": 80,
    "test_gpu_install.py": 100,
    "test_one_time_figures_resume.py": 15,  # these two: 12-36 s and 10-19 s alone under load (2026-12-07)
    "test_lora_first_tries.py": 12,  # two pip resolutions (vLLM 0.33 and 0.32 routes) since 2026-12-07
    "test_turn_loop_vllm.py": 60,  # these four: estimated from runs alone (2026-12-07)
    "test_tool_sandbox.py": 35,
    "test_group_step_adam_resume.py": 30,
    "test_turn_loop_train.py": 20,
    "test_turn_loop_resume.py": 150,  # these three: guessed from runs alone at load average 30-60 (2026-12-07:
    "test_turn_loop_peer_data.py": 45,  # 521 s, 60 s and 125 s there)
    "test_turn_loop_parallel.py": 80,
    "test_turn_credit_train.py": 80,  # estimated: four runs like test_turn_loop_train's (260 s at load average 35)
    "test_ctrl_c_windows.py": 90,  # 157 s at load average ~15 with the windows the clock found (2026-12-07)
    "test_hf_conversion.py": 47,
    "test_sft_preemption.py": 44,
    "test_rollout_vllm.py": 39,
    "test_tree_rollout_run.py": 36,
    "test_sequence_parallel.py": 30,
    "test_routing_replay.py": 27,
    "test_data_formats_cli.py": 26,
    "test_reward_preflight.py": 25,
    "test_eval_command.py": 25,
    "test_lora.py": 63,  # these two: alone at load average ~15 (2026-12-07)
    "test_lora_train.py": 85,
    "test_lora_peft_export.py": 60,  # these two: 84-120 s and 27-128 s alone under load (2026-12-07)
    "test_prm_lora.py": 50,
    "test_pipeline_command_lifetime.py": 60,  # 137 s at load average ~20 (2026-12-07)
    "test_rollout_trainer_lost.py": 30,  # 33-52 s under load (2026-12-07)
    # Files that start commands of their own, which alphabetical order put among the last queued (the very
    # last, test_warning_filters, is two interpreters importing megatron-core). Estimated from their CPU seconds
    # alone (`/usr/bin/time pytest FILE`, less the ~8.6 s a file of 6 in-process tests takes: start-up,
    # collection, the fork server), 2026-12-07: queued ahead of the in-process files, which fill in at the end.
    "test_forked_command.py": 20,  # 31 s of CPU
    "test_warning_filters.py": 15,  # 23 s of CPU
    "test_train_console.py": 11,  # 20 s of CPU
    "test_import_weight.py": 15,  # these three: 28 s, 18 s and 17 s together at load average ~8 (2026-12-07)
    "test_config_overrides.py": 10,
    "test_failure_lines.py": 10,
}


def pytest_configure(config):
    # xdist's reordering by test count would undo the order set below (the option exists from xdist 3.6 on).
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # A stable sort: the tests of a file stay together and in order, and files of equal weight keep theirs.
    items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))


@pytest.fixture(scope="session", autouse=True)
def shared_fork_server():
    """This worker's fork server, offered to the commands its tests start (in ``os.environ``, which they inherit);
    None where ranks are not forked (CUDA builds of torch)."""
    from grpo_mega.run.forked_ranks import forking_allowed
    from grpo_mega.run.launcher import PRELOADED
    from grpo_mega.run.shared_fork_server import SHARED_FORK_SERVER_ENV, SharedForkServer

    if not forking_allowed():
        yield None
        return
    server = SharedForkServer(PRELOADED)
    os.environ[SHARED_FORK_SERVER_ENV] = server.offer
    try:
        yield server
    finally:
        os.environ.pop(SHARED_FORK_SERVER_ENV, None)
        server.stop()
