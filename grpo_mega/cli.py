"""``grpo-mega``: the command line.

    grpo-mega train --config FILE [--nproc N] [--print-config] [key=value ...]   GRPO (outcome or process supervision)
    grpo-mega sft   --config FILE [--nproc N] [--print-config] [key=value ...]   supervised fine-tuning of the policy
    grpo-mega eval  --config FILE --policy PATH [--samples K] [--out FILE] [--nproc N] [key=value ...]
                                                                 a policy's held-out accuracy, without training
    grpo-mega quickstart [--run-dir DIR] [--regime sparse|dense|tools] [--no-oracle] [--implicit] [--fast] [--outcome-only]
                         [--iterations N]                       the CPU pipeline: data -> SFT -> PRM -> GRPO -> eval
    grpo-mega prm {label,train,score,eval} ...                  the process reward model (see prm/cli.py)
    grpo-mega plan --config FILE [--gpus-per-node N --gpu-memory-gib M --nodes K] [--assume NAME=VALUE] [--gpu-name A100] [--accept-unknown] [--json]
                   [--steps N [--device H100] [--mean-prompt T] [--mean-response T] [--sampling-rounds R]]
                   [key=value ...]                              memory per rank and phase; exit 1 if it does not fit;
                                                                with --steps also seconds per phase and GPU-hours

Under torchrun or srun the command runs as one rank of that job; otherwise ``--nproc N`` (default 1) starts N
processes on this machine with torchrun. Options and ``key=value`` overrides may come in any order.
"""

from __future__ import annotations

# first: a Ctrl-C while this module imports what follows (0.6 s under load) waits for main's try
from grpo_mega.run.interrupts import (EXIT_INTERRUPTED, catch_ctrl_c, end_interrupted, hold_ctrl_c_in_a_commands_start,
                                      import_torch_holding_ctrl_c, is_a_programs_own_process, pause_point)

hold_ctrl_c_in_a_commands_start(__name__)

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from grpo_mega.run.forked_command import can_run_forked  # noqa: E402
from grpo_mega.run.lifeline import end_with_the_launcher  # noqa: E402
from grpo_mega.run.module_main import end_without_torch_s_teardown  # noqa: E402
from grpo_mega.run.launcher import under_launcher  # noqa: E402
from grpo_mega.run.torchrun import relaunch_with_torchrun  # noqa: E402
from grpo_mega.run.library_warnings import quiet_libraries  # noqa: E402


def _parser(first_word: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``prm`` only named (in an error's usage line) for another command's: its options'
    modules import the config's (0.1-0.15 s of CPU a command's process, before it hands its work off, 2026-12-08)."""
    parser = argparse.ArgumentParser(prog="grpo-mega", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "GRPO (outcome or process supervision)"), ("sft", "supervised fine-tuning")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--config", required=True, help="YAML config file")
        command.add_argument("--nproc", type=int, default=1, help="processes to start here (ignored under torchrun/srun)")
        command.add_argument("--print-config", action="store_true",
                             help="print the resolved config (file + overrides + defaults) as YAML and exit")
        command.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=1e-6")
    evaluation = commands.add_parser("eval", help="a policy's held-out accuracy (eval/accuracy) under a GRPO config, "
                                     "without training: HF folder, converted folder, checkpoint or run directory")
    evaluation.add_argument("--config", required=True, help="GRPO YAML config: data.eval_file, reward, lengths, "
                            "trainer.eval_temperature, parallel.seed")
    evaluation.add_argument("--policy", required=True, help="an HF folder with weights, a converted megatron folder, "
                            "a grpo-mega training checkpoint or run directory")
    evaluation.add_argument("--samples", type=int, default=1, help="evaluations with seeds parallel.seed + 0..K-1 "
                            "(at a temperature > 0: the sampled pass@1 and its spread)")
    evaluation.add_argument("--out", default=None, help="write the report as JSON here")
    evaluation.add_argument("--nproc", type=int, default=1, help="processes to start here (ignored under torchrun/srun)")
    evaluation.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.eval_temperature=1.0")
    quick = commands.add_parser("quickstart", help="the CPU quickstart: data -> SFT -> PRM -> GRPO (outcome and "
                                   "process supervision) -> eval, with a summary")
    quick.add_argument("--run-dir", default="runs/quickstart")
    quick.add_argument("--regime", choices=("dense", "sparse", "tools"), default="dense",
                       help="dense (default): three-step chains every arm learns; sparse: five-step chains from a "
                            "briefly trained policy, where many outcome-GRPO groups carry no signal and the learned "
                            "PRM's arm comes out ahead (docs/results.md); tools: multi-digit chains that need a "
                            "calculator, text-only and tool-calling SFT policies and the GRPO arms' sparse start (the tool "
                            "checkpoint nearest 20 %% pass@1; GRPO arms: bench/pipeline_seeds.py --regime tools; "
                            "docs/quickstart.md)")
    quick.add_argument("--implicit", action="store_true",
                       help="also an arm with an implicit PRM trained online from the outcomes (PRIME: "
                            "process_reward.source=implicit), no step labels")
    quick.add_argument("--no-oracle", action="store_true",
                       help="skip the third arm, process supervision by the task's ground-truth step checker")
    quick.add_argument("--fast", action="store_true", help="a shortened run (the end-to-end test uses it)")
    quick.add_argument("--outcome-only", action="store_true",
                       help="data -> SFT -> outcome-supervised GRPO only (no PRM, no process-supervised arm)")
    quick.add_argument("--iterations", type=int, default=1,
                       help="iterative RL for the process-supervised arm: its GRPO steps in N runs, the PRM relabelled "
                            "on the current policy and trained on (with 10%% replay) between them")
    plan = commands.add_parser("plan", help="memory per rank and per phase of a GRPO config on GPUs, and whether it "
                                            "fits (exit status 1 when it does not)")
    plan.add_argument("--config", required=True, help="YAML config file")
    plan.add_argument("--gpus-per-node", type=int, help="default: the config header's '# hardware:' line")
    plan.add_argument("--gpu-memory-gib", type=float,
                      help="memory of one GPU as the device reports it (H100 80GB: 79.6)")
    plan.add_argument("--nodes", type=int, help="default: the config header's, else 1")
    plan.add_argument("--assume", action="append", default=[], metavar="NAME=VALUE",
                      help="plan with a memory setting the config does not set (distributed_optimizer, "
                           "sequence_parallel, recompute, offload_during_rollout), e.g. distributed_optimizer=true")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--gpu-name", default="", help="the GPU's name (e.g. A100): vLLM's default batch limits "
                      "are smaller on an A100; default: another GPU")
    plan.add_argument("--accept-unknown", action="store_true",
                      help="exit 0 for a plan that fits what it counted although a part could not be read")
    plan.add_argument("--steps", type=int, help="also predict seconds per phase, the step's seconds and GPU-hours "
                      "for this many steps (the step-time model, docs/performance.md 'Step time')")
    plan.add_argument("--device", help="device profile for --steps: H100, H200, H20, A100, B200 or CPU "
                      "(default: --gpu-name if it names one, else CPU for parallel.device=cpu, else H100)")
    plan.add_argument("--mean-prompt", type=float, help="mean prompt tokens for --steps "
                      "(default: data.prompt_length / 4)")
    plan.add_argument("--mean-response", type=float, help="mean response tokens for --steps "
                      "(default: algorithm.response_length / 2)")
    plan.add_argument("--sampling-rounds", type=float, default=1.0,
                      help="mean generation rounds per step for --steps (dynamic sampling; default 1)")
    plan.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.tensor=8")
    if first_word in commands.choices:
        commands.add_parser("prm")
    else:
        from prm.cli import add_prm_commands

        add_prm_commands(commands)
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line, its ``key=value`` overrides taken wherever they stand among the options (argparse takes
    one run of them: ``a=b --nproc 2 c=d`` would leave ``c=d`` unrecognized)."""
    parser = _parser(argv[0] if argv else None)  # the top level has no option but --help: the command comes first
    args, rest = parser.parse_known_args(argv)
    strays = [item for item in rest if item.startswith("-") or not hasattr(args, "overrides")]
    if strays:
        parser.error(f"unrecognized arguments: {' '.join(strays)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    return args


def _other_command(error: Exception) -> Exception:
    """``error``, or for a config file of another command (an SFT or PRM config given to ``train``) the error that
    names that command (``grpo_mega.config.loading.another_commands_config``)."""
    from grpo_mega.config import GRPOConfig, SFTConfig
    from grpo_mega.config.loading import another_commands_config
    from prm.config import PRMConfig

    if not isinstance(error, ValueError):
        return error
    schemas = {"grpo-mega train": GRPOConfig, "grpo-mega sft": SFTConfig, "grpo-mega prm train": PRMConfig}
    return another_commands_config(error, schemas)


def _config_error(command: str, error: Exception) -> int:
    """A config mistake: one line and exit status 2. Under a launcher the rank's failure line (with cause=config:
    the SLURM scripts do not requeue it); in the command's own process, before any rank started, the error alone."""
    error = _other_command(error)
    if under_launcher():
        from grpo_mega.run.failure import report_failure

        report_failure(f"grpo-mega {command}", None, error)
    else:
        print(f"grpo-mega {command}: error: {error}", file=sys.stderr)
    return 2


def _run_training(args) -> int:
    # grpo_mega.config imports torch (through grpo_mega.algo): imported here, when the command needs the config,
    # never at the CLI's import (`grpo-mega --help` stays light)
    from grpo_mega.config import ConfigError, GRPOConfig, SFTConfig, validate, validate_sft
    from grpo_mega.config.preflight import announce_verdict, launch_rank, load_checked, print_config, start_attempt

    schema, validator = (SFTConfig, validate_sft) if args.command == "sft" else (GRPOConfig, validate)
    if args.print_config:  # required keys not set are marked, not refused
        try:
            print_config(f"grpo-mega {args.command}", schema, validator, args.config, args.overrides)
        except ConfigError as error:
            return _config_error(args.command, error)
        return 0
    launched = under_launcher()
    try:  # every check before a rank starts: the config against the job's size, its paths, the run folder
        cfg = load_checked(schema, validator, args.config, args.overrides, world_size=None if launched else args.nproc)
        verdict = start_attempt(cfg, act=launch_rank() == 0)
    except ConfigError as error:
        return _config_error(args.command, error)
    announce_verdict(f"grpo-mega {args.command}", verdict)
    if verdict.complete:
        if not launched:  # the ranks of a job go on together: they resume at the last step and end
            return 0
    if not launched:
        _announce_start(args, cfg)
    if args.nproc > 1 and not launched:
        return relaunch_with_torchrun(args.nproc, ["grpo_mega.cli", args.command, "--config", args.config, *args.overrides])
    import_torch_holding_ctrl_c()  # after the checks (they stay torch-free): a Ctrl-C in torch's import was lost
    from grpo_mega.run.control import EXIT_STOPPED_EARLY, StoppedEarly, StoppedWithTheRun
    from grpo_mega.run.reaper import reap_group_when_rank_exits

    reap_group_when_rank_exits()  # the rank's helper processes end with it, however it ends
    if args.command == "sft":
        from grpo_mega.sft import run_sft as run
    else:
        from grpo_mega.trainer import train as run
    try:
        run(cfg)
    except StoppedEarly as stopped:  # a checkpoint was saved; the same command resumes (exit status 3)
        if not isinstance(stopped, StoppedWithTheRun):  # the ranks that stopped the run say it
            print(f"grpo-mega {args.command}: {stopped}", file=sys.stderr)
        return EXIT_STOPPED_EARLY
    except (Exception, KeyboardInterrupt) as error:  # one line; the traceback in failure.json and tracebacks/
        from grpo_mega.run.failure import exit_status, report_failure

        return exit_status(report_failure(f"grpo-mega {args.command}", cfg.trainer.run_dir, error))
    return 0


def _announce_start(args, cfg) -> None:
    """The line that says what ``train`` / ``sft`` builds before its first step (``grpo_mega.run.progress``)."""
    from grpo_mega.run.progress import announce_start

    builds, engines = ["the policy"], []
    if args.command == "train":
        builds.append(f"the rollout engine (rollout.engine={cfg.rollout.engine})")
        engines.append(cfg.rollout.engine)
        if cfg.process_reward.source == "prm":
            builds.append(f"the PRM (process_reward.scorer={cfg.process_reward.scorer})")
            engines.append(cfg.process_reward.scorer)
        elif cfg.process_reward.source == "implicit":
            builds.append("the implicit PRM")
    slow = "vLLM takes a minute or more to start" if "vllm" in engines else ""
    announce_start(f"grpo-mega {args.command}", args.nproc, builds, slow)


def main(argv: list[str] | None = None) -> int:
    command_line = argv is None  # this process is the command (not a caller of main's): it may hand its work off
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:  # from the first call on: a Ctrl-C while the command line is parsed (its imports) is one line too
        catch_ctrl_c()  # first: a process started with SIGINT ignored (a script's background job) must still stop
        end_with_the_launcher()  # a rank that grpo_mega.run.torchrun started as an interpreter dies with it
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        quiet_libraries()
        pause_point("cli.parse")  # tests: a Ctrl-C while the command line is parsed (prm.cli's imports)
        args = _parse(argv)
        name = _command_name(args)
        problem = _bad_count(args)
        if problem:
            print(f"grpo-mega {name}: error: {problem}", file=sys.stderr)
            return 2
        pause_point(f"cli.{name.replace(' ', '.')}")  # tests: a Ctrl-C while the command starts (imports)
        if command_line and _hands_off_its_work(args) and can_run_forked():  # the work forked from a preloaded server
            from grpo_mega.run.forked_command import run_forked

            return run_forked("grpo_mega.cli", argv)
        code = _run_command(args, argv)
        if command_line:  # its work done in this process (one process, a rank torchrun started as an interpreter)
            end_without_torch_s_teardown(code)
        return code
    except KeyboardInterrupt:  # before a run's own handling took over, or a command without a run folder
        if _launch_rank() == 0:
            print(_interrupted_line(args, argv), file=sys.stderr, flush=True)
        if command_line and is_a_programs_own_process():
            end_interrupted()  # exit 130, whatever the interrupted imports left to the interpreter's finalization
        return EXIT_INTERRUPTED


def _command_name(args) -> str:
    """``train``, ``prm score``, ...: the command ``args`` runs, as its lines name it."""
    return "prm " + args.prm_command if args.command == "prm" else args.command


def _interrupted_line(args, argv: list[str]) -> str:
    """The one line of a command stopped by Ctrl-C (``args``: its parsed command line, None while it was parsed)."""
    if args is None:  # nothing was started yet: the command's name as typed
        words = [word for word in argv[:2] if not word.startswith("-") and "=" not in word]
        name = " ".join(words if words[:1] == ["prm"] else words[:1])
        return f"grpo-mega{' ' + name if name else ''}: interrupted; nothing was written: run the same command again"
    return f"grpo-mega {_command_name(args)}: interrupted; {_how_to_continue(args)}"


def _hands_off_its_work(args) -> bool:
    """Whether the command's work imports torch (training, evaluation, the PRM's commands, on one process or
    relaunched under torchrun for several): not the light ``--print-config``, ``plan`` and pipelines."""
    if getattr(args, "print_config", False):
        return False
    if args.command == "prm":
        return args.prm_command in ("train", "label", "score", "eval")
    return args.command in ("train", "sft", "eval")


def _launch_rank() -> int:
    """This process's rank in a job its launcher started; 0 otherwise (the rank that speaks for the job)."""
    import os

    for variable in ("RANK", "SLURM_PROCID"):
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    return 0


def _how_to_continue(args) -> str:
    """What the interrupted command ``args`` kept, and the command that goes on from there."""
    if args.command == "quickstart":
        return f"{args.run_dir} keeps what finished (the same command continues)"
    if args.command in ("train", "sft") or getattr(args, "prm_command", None) == "train":
        return "the same command resumes from the run's last checkpoint (or starts it, if it has none)"
    return "nothing was written: run the same command again"


def _run_command(args, argv: list[str]) -> int:
    if args.command == "prm":
        from prm.cli import run_prm_command

        try:
            return run_prm_command(args, argv)
        except (ValueError, FileNotFoundError) as error:
            print(f"grpo-mega prm {args.prm_command}: {error}", file=sys.stderr)
            return 2
    if args.command == "quickstart":
        from grpo_mega.quickstart.pipeline import run_quickstart

        # a Ctrl-C ends here as in the other commands (main): the child command's own line is in its log
        return run_quickstart(args.run_dir, regime=args.regime, fast=args.fast, outcome_only=args.outcome_only,
                              oracle=not args.no_oracle, iterations=args.iterations, implicit=args.implicit)
    if args.command == "plan":
        return _run_plan(args)
    if args.command == "eval":
        return _run_eval(args, argv)
    return _run_training(args)


COUNTS = {"nproc": "--nproc", "samples": "--samples", "iterations": "--iterations", "gpus_per_node": "--gpus-per-node",
          "gpu_memory_gib": "--gpu-memory-gib", "nodes": "--nodes", "steps": "--steps", "max_prompts": "--max-prompts"}
"""Counts on the command line that must be positive when given (0 is no default: it is refused)."""


def _bad_count(args) -> str | None:
    """Why a count option of ``args`` is unusable (0 or negative), or None."""
    for name, flag in COUNTS.items():
        value = getattr(args, name, None)
        if isinstance(value, (int, float)) and not value > 0:  # prm label's --steps is a word (text | turns)
            return f"{flag} {value:g} must be > 0" if isinstance(value, float) else f"{flag} {value} must be >= 1"
    return None


def _run_eval(args, argv: list[str]) -> int:
    from grpo_mega.config import ConfigError, GRPOConfig, validate
    from grpo_mega.config.preflight import (check_policy_vocabulary, check_weights_folder, load_checked,
                                            note_prm_as_policy)

    launched = under_launcher()
    try:  # the evaluation splits prompts over its processes at parallel.tensor (no pipeline): checked here
        cfg = load_checked(GRPOConfig, validate, args.config, args.overrides, world_size=0)
        if not launched and args.nproc % cfg.parallel.tensor:
            raise ConfigError(f"parallel.tensor={cfg.parallel.tensor} does not divide --nproc {args.nproc}: start a "
                              f"multiple of {cfg.parallel.tensor} processes or set parallel.tensor=1")
        if not cfg.data.eval_file:
            raise ConfigError("grpo-mega eval needs data.eval_file (the held-out prompts)")
        if not Path(args.policy).exists():
            raise ConfigError(f"--policy {args.policy}: no such folder (an HF folder, a converted megatron folder, "
                              "a grpo-mega checkpoint or run directory)")
        check_weights_folder("--policy", args.policy)  # what the ranks would find after torch's import
        check_policy_vocabulary(cfg, args.policy)
        note_prm_as_policy("--policy", args.policy)
    except ConfigError as error:
        print(f"grpo-mega eval: error: {_other_command(error)}", file=sys.stderr)
        return 2
    if not launched:
        from grpo_mega.run.progress import announce_start

        # on stderr, where its phase lines go
        announce_start("grpo-mega eval", args.nproc, ["the policy"], then="a line per phase follows", out=sys.stderr)
    if args.nproc > 1 and not launched:
        return relaunch_with_torchrun(args.nproc, ["grpo_mega.cli", *argv])
    import_torch_holding_ctrl_c()  # after the checks, as in _run_training
    from grpo_mega.eval_command import run_eval_command

    try:
        return run_eval_command(cfg, args.policy, samples=args.samples, out=args.out)
    except (ValueError, FileNotFoundError) as error:
        print(f"grpo-mega eval: error: {error}", file=sys.stderr)
        return 2


def _run_plan(args) -> int:
    import functools
    import json

    from grpo_mega.config import ConfigError, GRPOConfig, load_config, validate
    from grpo_mega.plan import plan_config
    from grpo_mega.plan.report import format_table, to_dict
    from grpo_mega.plan.settings import documented_hardware, documented_shape, parse_assume, planning_overrides

    try:
        overrides, filled_notes = planning_overrides(args.config, args.overrides)
        cfg = load_config(GRPOConfig, args.config, overrides, functools.partial(validate, world_size=0))
        documented = documented_hardware(args.config)
        gpus = args.gpus_per_node if args.gpus_per_node is not None else (
            documented.gpus_per_node if documented else None)
        memory = args.gpu_memory_gib if args.gpu_memory_gib is not None else (
            documented.gpu_memory_gib if documented else None)
        nodes = args.nodes if args.nodes is not None else (documented.nodes if documented else 1)
        if gpus is None or memory is None:
            raise ConfigError(f"{args.config} documents no '# hardware: 1 node x 8 GPUs x 79.6 GiB' line: "
                              "pass --gpus-per-node and --gpu-memory-gib")
        plan = plan_config(cfg, gpus_per_node=gpus, gpu_memory_gib=memory, nodes=nodes, gpu_name=args.gpu_name,
                           assume=parse_assume(args.assume), config_name=args.config,
                           prm_shape=documented_shape(args.config, "prm"))
        plan.notes[:0] = filled_notes
        timed = _plan_step_time(args, cfg, plan) if args.steps is not None else None
    except (ConfigError, ValueError) as error:
        print(f"grpo-mega plan: {_other_command(error)}", file=sys.stderr)
        return 2
    if args.json:
        out = to_dict(plan)
        if timed is not None:
            out["step_time"] = timed[1]
        print(json.dumps(out, indent=1))
    else:
        print(format_table(plan, accept_unknown=args.accept_unknown))
        if timed is not None:
            print(timed[0])
    return 0 if plan.verdict_fits(accept_unknown=args.accept_unknown) else 1


def _plan_step_time(args, cfg, plan) -> tuple[str, dict]:
    """(The step-time table, its JSON) for ``grpo-mega plan --steps N``."""
    from grpo_mega.config import ConfigError
    from grpo_mega.plan.devices import PROFILES, device_profile
    from grpo_mega.plan.report import format_step_time, step_time_dict
    from grpo_mega.plan.settings import documented_device
    from grpo_mega.plan.step_time import fitted_efficiency
    from grpo_mega.plan.timing import Assumptions, config_step_time

    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: expected >= 1")
    if args.device:
        device = device_profile(args.device)
    elif args.gpu_name and any(key in args.gpu_name.upper() for key in PROFILES if key != "CPU"):
        device = device_profile(args.gpu_name)
    elif documented_device(args.config):  # the hardware the config was written for, as its memory plan
        device = device_profile(documented_device(args.config))
    else:
        device = device_profile("CPU" if cfg.parallel.device == "cpu" else "H100")
    eff = fitted_efficiency(device)
    step, one_off = config_step_time(cfg, plan, device, eff, Assumptions(
        mean_prompt=args.mean_prompt, mean_response=args.mean_response, sampling_rounds=args.sampling_rounds))
    if device.name == "CPU":
        step.notes.append("the factors fitted on this project's 2-core CPU (bench/results/step_time_cpu.json; "
                          "held-out steps +6 to +41 %, the 25M model's the worst): another CPU measures its own")
    return (format_step_time(step, one_off, args.steps, device, eff),
            step_time_dict(step, one_off, args.steps, device, eff))


if __name__ == "__main__":
    sys.exit(main())
