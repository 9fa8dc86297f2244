"""`grpo-mega train` rejects a bad config at start-up, naming the key. (Resuming: test_trainer_hardening's killed
and resumed run, test_trainer_preemption and test_slurm.)"""

from pathlib import Path

from cli_runner import run_grpo_mega

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "quickstart_grpo.yaml"


def test_unknown_config_key_fails_at_start_naming_the_key(tmp_path):
    result = run_grpo_mega("train", "--config", str(CONFIG), "algorithm.not_a_key=1", "model.hf_config=x",
                           "data.train_file=y", timeout=120)
    assert result.returncode == 2
    assert "algorithm.not_a_key" in result.stderr
