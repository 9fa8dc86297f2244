"""Suite-wide: the order in which test files are queued for the workers of ``make test``.

``make test`` runs ``pytest -n 2 --dist loadfile``: each worker takes whole files, one after another. pytest-xdist
(>= 3.6) queues the files by their number of tests, most first. In this suite the slowest files have few tests,
each a multi-process run of a minute or more, so that order put them last: the quickstart end to end (2 tests,
~5 min) was the second-to-last file queued and ran alone while the other worker had nothing left. Here the slow
files are queued first, longest first, and every other file after them in collection order: the many short files
then fill in around the long ones and both workers finish at about the same time.
"""

from __future__ import annotations

# Approximate seconds of the slowest files under `make test` (2 cores, CI and local runs of 2026-11-24); only their
# order matters, and a file missing here just runs after them.
SLOW_FILES = {
    "test_slurm.py": 330,
    "test_quickstart_e2e.py": 320,
    "test_trainer_hardening.py": 290,
    "test_trainer_preemption.py": 230,
    "test_prm_commands.py": 220,
    "test_slurm_two_nodes.py": 240,  # 2026-11-25: 142 s alone, 240 s beside test_slurm.py on the other worker
    "test_readme_small_model.py": 200,
    "test_hf_conversion.py": 170,
    "test_small_model_compare.py": 150,
    "test_rollout_vllm.py": 130,
    "test_engine_deepspeed.py": 110,
    "test_gpu_check.py": 90,
    "test_training_checkpoint.py": 100,
    "test_prm_conversion.py": 75,
    "test_prm_labeling.py": 60,
    "test_prm_deepspeed.py": 60,
    "test_model_parallel.py": 55,
    "test_engine_megatron.py": 55,
    "test_prm_replay.py": 50,
    "test_prm_model.py": 45,
    "test_engine_reference.py": 45,
    "test_warning_filters.py": 40,
    "test_stages_update.py": 35,
}


def pytest_configure(config):
    # xdist's reordering by test count would undo the order set below (the option exists from xdist 3.6 on).
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    # A stable sort: the tests of a file stay together and in order, and files of equal weight keep theirs.
    items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))
