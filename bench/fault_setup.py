"""The runs bench/faults.py injects faults into: the tiny synthetic task (quickstart data and model, random
weights), and for the process-supervised runs a PRM trained on it first (planted-error step labels)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRPO_CONFIG = ROOT / "configs" / "quickstart_grpo.yaml"
PRM_CONFIG = ROOT / "configs" / "quickstart_prm.yaml"
TOTAL_STEPS = 6
SHARED = ["trainer.progress_bar=false", "trainer.tensorboard=false", "parallel.device=cpu", "parallel.tensor=2",
          "trainer.save_every=2", "trainer.eval_every=0"]
GRPO_RUN = ["algorithm.rollout_batch_size=4", "algorithm.num_return_sequences_in_group=2",
            "algorithm.response_length=12", "algorithm.dynamic_sampling=false", "trainer.dump_rollouts=true",
            f"trainer.total_steps={TOTAL_STEPS}"]


@dataclass
class FaultTask:
    model: Path
    train_file: Path
    policy: Path
    prm_train_file: Path | None = None
    prm: Path | None = None
    total_steps: int = TOTAL_STEPS

    @staticmethod
    def kind(fault: str) -> str:
        """Which command a fault's trials run (trials of one kind share an uninterrupted reference run)."""
        return {"prm_exception": "grpo-prm", "vllm_wake": "grpo-vllm", "prm_sigkill": "prm-train"}.get(fault, "grpo")

    def arguments(self, fault: str, run_dir: Path, timeout: int) -> list[str]:
        """``grpo-mega`` arguments of the runs of ``fault`` (its trials and their uninterrupted reference)."""
        common = [f"model.hf_config={self.model}", f"trainer.run_dir={run_dir}",
                  f"trainer.collective_timeout_s={timeout}", *SHARED]
        kind = self.kind(fault)
        if kind == "prm-train":
            return ["prm", "train", "--config", str(PRM_CONFIG), *common, *self._prm_training(8)]
        grpo = ["train", "--config", str(GRPO_CONFIG), *common, f"data.train_file={self.train_file}", *GRPO_RUN]
        if kind == "grpo-prm":
            grpo += ["algorithm.supervision=process", "process_reward.source=prm", f"process_reward.prm={self.prm}"]
        if kind == "grpo-vllm":
            grpo += ["rollout.engine=vllm"]
        return grpo

    def _prm_training(self, steps: int) -> list[str]:
        return [f"model.init_from={self.policy}", f"data.train_file={self.prm_train_file}", "data.eval_file=null",
                f"trainer.total_steps={steps}", "trainer.batch_size=8", "optim.warmup_steps=0",
                "optim.decay_style=constant", "prm.layout=classifier", 'prm.step_tag=" ки"', "optim.lr=1e-3"]


def build_fault_task(root: Path, *, needs_prm: bool, env: dict) -> FaultTask:
    """The task under ``root`` (reused when there), with a trained PRM when ``needs_prm``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_mega.data.synthetic import Difficulty, read_jsonl
    from grpo_mega.quickstart.pipeline import QuickstartPlan, build_data_and_model
    from prm.data import write_stepwise
    from prm.synthetic import planted_error_examples

    plan = QuickstartPlan(num_train=200, num_heldout=8, difficulty=Difficulty(min_steps=2, max_steps=2, max_value=30))
    model, train_file, _ = build_data_and_model(root, plan)
    policy = root / "policy_hf"
    if not policy.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(policy)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (policy / name).write_bytes((model / name).read_bytes())
    task = FaultTask(model, train_file, policy)
    if needs_prm:
        task.prm_train_file = root / "prm_train.jsonl"
        write_stepwise(task.prm_train_file, planted_error_examples(read_jsonl(train_file)[:48], seed=1))
        task.prm = root / "prm"
        if not (task.prm / "checkpoints" / "latest").exists():
            command = [sys.executable, "-m", "grpo_mega.cli", "prm", "train", "--config", str(PRM_CONFIG),
                       "--nproc", "2", f"model.hf_config={model}", f"trainer.run_dir={task.prm}", *SHARED,
                       *task._prm_training(4)]
            subprocess.run(command, check=True, env=env, cwd=ROOT, capture_output=True)
    return task
