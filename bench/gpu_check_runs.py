"""The GPU check's stages that run grpo-mega's own commands in fresh processes (``bench/gpu_check.py`` runs them):
``grpo-mega sft``, ``grpo-mega train`` (hf rollouts, interrupted and resumed; asynchronous rollouts on two
processes; one step on vLLM), and the HF
conversion tools; with the checks on what those runs logged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_check_stages import check_memory_band
from workload import train_flops

REPO = Path(__file__).resolve().parents[1]

# Mean |sampler - trainer| log-prob per token above which the weight sync or a kernel is wrong, not just rounding.
MAX_LOGPROB_DIFF_MEAN = 0.1


# ----------------------------------------------------------------------------- 3. SFT
def _grpo_mega(args: list[str], log: Path, timeout: float) -> None:
    """``python -m grpo_mega.cli ...`` in a new process (world size 1), its output in ``log``; raises on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "bench"),
                                                      os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        code = subprocess.run([sys.executable, "-m", "grpo_mega.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO, timeout=timeout).returncode
    if code != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"grpo-mega {args[0]} exited with {code}; last output:\n{tail}")


def _rows(metrics_file: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def stage_sft(work: Path, task: dict, device: str, settings: dict) -> dict:
    run_dir = work / "sft"
    _grpo_mega(["sft", "--config", str(REPO / "configs/quickstart_sft.yaml"), f"model.hf_config={task['model_dir']}",
                f"data.train_file={task['train_file']}", f"trainer.run_dir={run_dir}", f"parallel.device={device}",
                f"trainer.total_steps={settings['sft_steps']}", f"trainer.batch_size={settings['sft_batch']}",
                f"optim.lr={settings['sft_lr']}", f"optim.min_lr={settings['sft_lr'] / 10}",
                f"optim.warmup_steps={max(1, settings['sft_steps'] // 10)}",
                f"parallel.max_tokens_per_micro_batch={settings['micro_tokens']}",
                "trainer.progress_bar=false", "trainer.tensorboard=false"], run_dir.with_suffix(".log"), timeout=1800)
    rows = _rows(run_dir / "metrics.jsonl")
    steps = [row["step"] for row in rows]
    if steps != list(range(1, settings["sft_steps"] + 1)):
        raise AssertionError(f"SFT logged steps {steps}")
    warm = rows[len(rows) // 3:]
    seconds_per_step = (warm[-1]["time"] - warm[0]["time"]) / max(1, len(warm) - 1)
    nll = [row.get("sft/nll") for row in rows]
    tokens = [row.get("perf/num_tokens") for row in rows if row.get("perf/num_tokens")]
    figures = {"steps": len(rows), "nll_first": nll[0], "nll_last": nll[-1], "seconds_per_step": seconds_per_step,
               "checkpoint": str(run_dir)}
    if tokens:
        figures["tokens_per_second"] = sum(tokens[len(rows) // 3:]) / len(warm) / seconds_per_step
    if not (nll[-1] is not None and nll[-1] < nll[0]):
        raise AssertionError(f"SFT did not lower the NLL: {nll[0]} -> {nll[-1]}")
    return figures


# ----------------------------------------------------------------------------- 4. GRPO, interrupted and resumed
# Items of a plan phase that torch's allocator does not hold (the measured peaks are torch's).
OUTSIDE_TORCH = ("CUDA context", "NCCL", "vLLM CUDA graphs")


def _grpo_arguments(work: Path, task: dict, device: str, settings: dict, run_dir: Path) -> list[str]:
    """``grpo-mega train`` arguments of the check's GRPO runs: the quickstart config on the task, from the SFT
    checkpoint, with the stage's sizes."""
    return ["--config", str(REPO / "configs/quickstart_grpo.yaml"), f"model.hf_config={task['model_dir']}",
            f"model.init_from={work / 'sft'}", f"data.train_file={task['train_file']}", f"trainer.run_dir={run_dir}",
            f"parallel.device={device}", f"algorithm.rollout_batch_size={settings['rollout_batch']}",
            f"algorithm.num_return_sequences_in_group={settings['group']}",
            f"algorithm.response_length={settings['response_length']}", "algorithm.dynamic_sampling=false",
            # bench/workload.py's digit reward: deterministic, with spread inside every group even for a barely
            # trained policy, so every step does a full update with non-zero advantages
            "reward.function=workload:digit_reward",
            f"optim.lr={settings['grpo_lr']}", f"parallel.max_tokens_per_micro_batch={settings['micro_tokens']}",
            "trainer.eval_every=0", "trainer.progress_bar=false", "trainer.tensorboard=false"]


def _plan_of_run(run_dir: Path, device: str):
    """``grpo-mega plan`` of the run's own saved config for one rank of this device (GPU: its memory and name; CPU:
    the host's memory)."""
    import torch

    from grpo_mega.config import GRPOConfig, load_config
    from grpo_mega.plan import plan_config

    cfg = load_config(GRPOConfig, run_dir / "config.yaml")
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        return plan_config(cfg, gpus_per_node=1, gpu_memory_gib=properties.total_memory / 2**30,
                           gpu_name=properties.name)
    import psutil

    return plan_config(cfg, gpus_per_node=1, gpu_memory_gib=psutil.virtual_memory().total / 2**30)


def _split_outside_torch(items: dict[str, int]) -> tuple[dict[str, int], int]:
    """(the items torch's allocator holds, the bytes of those it does not)."""
    inside = {name: value for name, value in items.items() if name not in OUTSIDE_TORCH}
    return inside, sum(value for name, value in items.items() if name in OUTSIDE_TORCH)


def stage_grpo(work: Path, task: dict, device: str, settings: dict, grpo_steps: int, peak_tflops: dict,
               resume: bool = True) -> dict:
    """``resume``: stop after ``grpo_steps - 1`` steps and resume for the last (the full check); without it one run
    of ``grpo_steps`` (``--quick``: one process start less)."""
    run_dir = work / "grpo"
    common = [*_grpo_arguments(work, task, device, settings, run_dir), f"data.eval_file={task['heldout_file']}",
              "data.max_eval_prompts=16", "trainer.keep_last=2"]
    if resume:
        # The first run stops after grpo_steps - 1 steps (its end saves a checkpoint); the second resumes from it.
        first = grpo_steps - 1
        _grpo_mega(["train", *common, f"trainer.total_steps={first}"], work / "grpo_first.log", timeout=1800)
        _grpo_mega(["train", *common, f"trainer.total_steps={grpo_steps}"], work / "grpo_resumed.log", timeout=1800)
        resumed_log = (work / "grpo_resumed.log").read_text()
        if f"at step {first}" not in resumed_log:
            raise AssertionError(f"the second run did not resume from step {first}:\n{resumed_log[-2000:]}")
    else:
        _grpo_mega(["train", *common, f"trainer.total_steps={grpo_steps}"],
                   work / "grpo.log", timeout=1800)
    rows = [row for row in _rows(run_dir / "metrics.jsonl") if row["step"] > 0]
    steps = [row["step"] for row in rows]
    if steps != list(range(1, grpo_steps + 1)):
        raise AssertionError(f"GRPO logged steps {steps}, expected 1..{grpo_steps} once each")
    trained_rows = settings["rollout_batch"] * settings["group"]  # dynamic sampling is off: every row is trained
    check_logprob_agreement(rows)
    steps = [_step_figures(row, task, trained_rows, peak_tflops) for row in rows]
    memory = memory_against_plan(run_dir, device, task, steps[-1])
    if device == "cuda":  # on the CPU the measured figure is the process's resident memory: no check of the plan
        check_memory_band(memory["measured_update_peak_gib"], memory["planned_update_in_torch_gib"], "update (hf)")
    return {"steps": steps, "memory_vs_plan": memory, "time_vs_model": time_against_model(run_dir, device, rows[-1])}


def time_against_model(run_dir: Path, device: str, row: dict) -> dict:
    """``grpo-mega plan --steps``'s seconds per phase for the run's own config (this device's profile, the step's
    measured mean prompt and response tokens, the shipped factors) beside the last step's measured ``timing_s/*``:
    the record that confirms or falsifies the step-time model on a new device. A device without a profile is
    recorded as such."""
    import torch

    from grpo_mega.config import ConfigError, GRPOConfig, load_config
    from grpo_mega.plan.devices import device_profile
    from grpo_mega.plan.step_time import fitted_efficiency
    from grpo_mega.plan.timing import Assumptions, config_step_time

    name = torch.cuda.get_device_properties(0).name if device == "cuda" else "CPU"
    try:
        profile = device_profile(name)
    except ConfigError as error:
        return {"device": name, "not_predicted": str(error)}
    cfg = load_config(GRPOConfig, run_dir / "config.yaml")
    rows = cfg.algorithm.rollout_batch_size * cfg.algorithm.num_return_sequences_in_group
    response = row["perf/num_response_tokens"] / rows
    prompt = (row["perf/num_tokens"] - row["perf/num_response_tokens"]) / rows
    step, _ = config_step_time(cfg, _plan_of_run(run_dir, device), profile, fitted_efficiency(profile), Assumptions(
        mean_prompt=min(prompt, cfg.data.prompt_length), mean_response=min(response, cfg.algorithm.response_length)))
    measured = {"generation": row.get("timing_s/gen"), "update": row.get("timing_s/update"),
                "old_logprobs": row.get("timing_s/old_logprob"), "weight_sync": row.get("timing_s/sync"),
                "step": row.get("timing_s/step")}
    predicted = {**step.phases, "step": step.seconds}
    return {"device": profile.name, "mean_prompt": prompt, "mean_response": response,
            "predicted_s": predicted, "measured_s": measured,
            "predicted_over_measured": {k: predicted[k] / v for k, v in measured.items() if v and k in predicted}}


def memory_against_plan(run_dir: Path, device: str, task: dict, last_step: dict) -> dict:
    """``grpo-mega plan``'s update phase for the run's own config (one rank, this device's memory) beside the update
    phase the trainer measured (``memory/update/peak_gib``). On a GPU the measured figure is torch's peak allocated
    bytes, which hold what the plan counts less the CUDA context and NCCL (outside torch's allocator), plus the hf
    rollout engine's bf16 copy of the weights (on the GPU all run long; the plan models vLLM, which sleeps); on the
    CPU it is the process's resident memory, which holds the Python and library runtime too, so only the GPU figure
    is a check of the plan."""
    update, outside_torch = _split_outside_torch(_plan_of_run(run_dir, device).phase("update").items)
    rollout_weights = task["parameters"] * (2 if device == "cuda" else 4)
    planned = (sum(update.values()) + rollout_weights) / 2**30
    figures = {"planned_update_items_gib": {name: value / 2**30 for name, value in update.items()},
               "planned_outside_torch_gib": outside_torch / 2**30, "hf_rollout_weights_gib": rollout_weights / 2**30,
               "planned_update_in_torch_gib": planned, "measured_update_peak_gib": last_step.get("memory/update/peak_gib")}
    if figures["measured_update_peak_gib"]:
        figures["measured_over_planned"] = figures["measured_update_peak_gib"] / planned
    return figures


def check_logprob_agreement(rows: list[dict]) -> None:
    """The sampler's log-probs against the trainer's on the same weights: bf16 kernels differ by ~1e-2 per token on
    average; a stale or wrong weight sync by ~1 (another model). AssertionError naming the step past the bound."""
    for row in rows:
        if not row.get("rollout/logprob_diff_mean", float("inf")) < MAX_LOGPROB_DIFF_MEAN:
            raise AssertionError(f"step {row['step']}: sampler / trainer log-prob difference "
                                 f"{row.get('rollout/logprob_diff_mean')} >= {MAX_LOGPROB_DIFF_MEAN}")


def _step_figures(row: dict, task: dict, trained_rows: int, peak_tflops: dict) -> dict:
    """One GRPO step's figures from its metrics row: throughputs, model FLOP utilisation, memory, timings."""
    figures = {key: value for key, value in row.items()
               if key.startswith(("timing_s/", "memory/", "rollout/logprob_diff", "rollout/probs_diff", "perf/"))}
    figures.update(step=row["step"], loss=row.get("actor/loss"), grad_norm=row.get("actor/grad_norm"))
    response_tokens, generation = row.get("perf/num_response_tokens"), row.get("timing_s/gen")
    if response_tokens and generation:
        figures["generation_tokens_per_second"] = response_tokens / generation
    layer_tokens, update = row.get("perf/layer_tokens"), row.get("timing_s/update")
    if layer_tokens and update:
        figures["update_tokens_per_second"] = layer_tokens / update
        # The update's forward + backward: 6 x matmul parameters per token put through the layers, and causal
        # attention over the average row (prompt + response) length.
        length = int(row.get("perf/num_tokens", layer_tokens) / trained_rows)
        flops = train_flops(task["matmul_parameters"], task["config"], int(layer_tokens), [length] * trained_rows)
        for name, peak in peak_tflops.items():
            if peak:
                figures[f"update_mfu_vs_{name}"] = flops / update / (peak * 1e12)
    return figures


def stage_grpo_async(work: Path, task: dict, device: str, settings: dict) -> dict:
    """Two GRPO steps with asynchronous rollouts (``rollout.mode: async``, staleness 0, hf engine): one training and
    one rollout process (on one GPU both share it), each its own world (NCCL on a GPU), the weights crossing the
    gloo bridge through host memory after every update. At staleness 0 the sampler's log-probs must agree with the
    trainer's as in colocated mode: a bridge that garbled or skipped a version fails it."""
    run_dir = work / "grpo_async"
    _grpo_mega(["train", "--nproc", "2", *_grpo_arguments(work, task, device, settings, run_dir), "parallel.tensor=1",
                "rollout.mode=async", "rollout.max_staleness=0", "trainer.total_steps=2"], work / "grpo_async.log",
               timeout=1800)
    rows = [row for row in _rows(run_dir / "metrics.jsonl") if row["step"] > 0]
    if [row["step"] for row in rows] != [1, 2]:
        raise AssertionError(f"the async GRPO run logged steps {[row['step'] for row in rows]}")
    check_logprob_agreement(rows)
    if [row["async/weights_version"] for row in rows] != [0, 1]:
        raise AssertionError(f"weights versions {[row['async/weights_version'] for row in rows]}, expected [0, 1]")
    keys = ("rollout/logprob_diff_mean", "async/trainer_wait_s", "async/weights_send_s", "async/weights_receive_s",
            "perf/sync_bytes", "async/generation_tokens_per_s", "timing_s/update")
    return {"steps": [{"step": row["step"], **{key: row.get(key) for key in keys}} for row in rows]}


def stage_grpo_vllm(work: Path, task: dict, device: str, settings: dict) -> dict:
    """One GRPO step with the vllm rollout engine from the SFT checkpoint: the sampler / trainer log-prob agreement,
    and on a GPU the generation phase's whole-device memory and the update's peak against the plan's."""
    run_dir = work / "grpo_vllm"
    _grpo_mega(["train", *_grpo_arguments(work, task, device, settings, run_dir), "rollout.engine=vllm",
                "rollout.gpu_memory_utilization=0.3", "trainer.total_steps=1"], work / "grpo_vllm.log", timeout=1800)
    rows = [row for row in _rows(run_dir / "metrics.jsonl") if row["step"] > 0]
    if [row["step"] for row in rows] != [1]:
        raise AssertionError(f"the vLLM GRPO run logged steps {[row['step'] for row in rows]}")
    check_logprob_agreement(rows)
    row = rows[0]
    figures = {"logprob_diff_mean": row.get("rollout/logprob_diff_mean"),
               "memory": {key: value for key, value in row.items() if key.startswith("memory/")}}
    if device == "cuda":
        plan = _plan_of_run(run_dir, device)
        update, outside_torch = _split_outside_torch(plan.phase("update").items)
        figures["planned_generation_gib"] = plan.phase("generation").total / 2**30
        figures["planned_update_in_torch_gib"] = sum(update.values()) / 2**30
        figures["planned_outside_torch_gib"] = outside_torch / 2**30
        figures["generation_over_plan"] = check_memory_band(
            row.get("memory/generation/device_used_gib"), figures["planned_generation_gib"], "generation (vllm)")
        figures["update_over_plan"] = check_memory_band(
            row.get("memory/update/peak_gib"), figures["planned_update_in_torch_gib"], "update (vllm)")
    return figures


# ----------------------------------------------------------------------------- 5. conversion vs HF logits
def stage_conversion(work: Path, device: str) -> dict:
    """The SFT checkpoint -> HF folder -> megatron checkpoint again, then megatron vs transformers logits. On a GPU
    each tool runs as the command a user types; on the CPU (the test suite's run) in this process
    (:func:`_tool_in_process`)."""
    hf_dir, mcore_dir = work / "sft_hf", work / "sft_mcore"
    tool = _tool if device == "cuda" else _tool_in_process
    tool("convert_mcore_to_hf.py", "--ckpt", str(work / "sft"), "--out", str(hf_dir), "--dtype", "float32")
    tool("convert_hf_to_mcore.py", "--hf", str(hf_dir), "--out", str(mcore_dir))
    output = tool("compare_with_hf.py", "--hf", str(hf_dir), "--ckpt", str(mcore_dir), "--seq-len", "64",
                  "--atol", "1e-3")
    return {"compare_output": [line.strip() for line in output.splitlines()
                               if line.startswith(("max |logit", "cosine", "next-token", "PASS"))]}


def _tool(script: str, *args: str) -> str:
    """Run ``tools/<script>``; its output, or RuntimeError with the output's end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO / "tools" / script), *args], capture_output=True, text=True,
                          env=env, timeout=1200)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{script} exited with {done.returncode}:\n{output[-3000:]}")
    return output


def _tool_in_process(script: str, *args: str) -> str:
    """``tools/<script>``'s ``main`` in this process, which has imported what it needs (its one-rank job runs here:
    ``run_as_the_only_rank``, which leaves no process group), instead of an interpreter importing torch,
    transformers and megatron-core again (~8 s of CPU each on a 2-core machine); its printed output, or RuntimeError
    with the output's end where it exits (``fail``, or compare_with_hf's exit 1)."""
    import contextlib
    import importlib
    import io

    tools = str(REPO / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            importlib.import_module(Path(script).stem).main(list(args))
    except SystemExit as error:
        raise RuntimeError(f"{script} exited with {error.code}:\n{output.getvalue()[-3000:]}") from None
    return output.getvalue()
