"""``grpo-mega prm {label,train,score,eval}``: the PRM's commands. Each writes a JSON or jsonl output and prints
its path as the last line.

    grpo-mega prm label --policy CKPT --data FILE --n 8 --out FILE        Monte-Carlo step labels
    grpo-mega prm train --config FILE [--print-config] [key=value ...]    train the PRM
    grpo-mega prm score --prm PATH --data FILE --out FILE.jsonl           step scores of every row
    grpo-mega prm eval  --prm PATH [--data FILE] [--policy CKPT --prompts FILE] --out FILE.json

``--nproc N`` starts N local processes under torchrun (default: the PRM's or policy's tp x pp; for ``train``
the config's parallel layout); under torchrun or srun each process is one rank of that job.
"""

from __future__ import annotations

import sys

COMMANDS = {
    "label": "Monte-Carlo step labels from the policy's rollouts",
    "train": "train the PRM (TP/PP/DP, checkpoints, resume)",
    "score": "score every step of every row of a data file",
    "eval": "step accuracy / F1, ProcessBench F1, best-of-N reranking",
}


def add_prm_commands(commands) -> None:
    """Add ``prm`` and its subcommands to the ``grpo-mega`` subparsers."""
    from prm.eval_command import add_eval_arguments
    from prm.label_command import add_label_arguments
    from prm.scoring import add_score_arguments

    prm = commands.add_parser("prm", help="the process reward model: label, train, score, eval")
    sub = prm.add_subparsers(dest="prm_command", required=True)
    adders = {"label": add_label_arguments, "score": add_score_arguments, "eval": add_eval_arguments}
    for name, help_text in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.add_argument("--nproc", type=int, default=None, help="processes to start here (ignored under torchrun)")
        if name == "train":
            command.add_argument("--config", required=True, help="YAML config file (see configs/quickstart_prm.yaml)")
            command.add_argument("--print-config", action="store_true",
                                 help="print the resolved config (file + overrides + defaults) as YAML and exit")
            command.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=1e-5")
        else:
            adders[name](command)


def _default_nproc(args) -> int:
    return getattr(args, "tp", 1) * getattr(args, "pp", 1)


def run_prm_command(args, argv: list[str]) -> int:
    """Run ``grpo-mega prm <command>``: relaunch under torchrun when asked for several processes, else run as
    this rank and print the output path last. Returns the exit status."""
    from grpo_mega.run.interrupts import import_torch_holding_ctrl_c
    from grpo_mega.run.launcher import under_launcher
    from grpo_mega.run.torchrun import relaunch_with_torchrun

    cfg = None
    if args.prm_command == "train":
        from grpo_mega.config import ConfigError, launched_world_size, load_config, validate_world_size
        from grpo_mega.config.preflight import (announce_verdict, check_paths, launch_rank, print_config,
                                                start_attempt)
        from prm.config import PRMConfig, validate_prm

        launched = under_launcher()
        try:  # every check before a rank starts: the config against the job's size, its paths, the run folder
            if args.print_config:  # required keys not set are marked, not refused
                print_config("grpo-mega prm train", PRMConfig, validate_prm, args.config, args.overrides)
                return 0
            cfg = load_config(PRMConfig, args.config, args.overrides, validate_prm)
            nproc = args.nproc or cfg.parallel.tensor * cfg.parallel.pipeline
            validate_world_size(cfg.parallel, launched_world_size() if launched else nproc)
            check_paths(cfg)
            verdict = start_attempt(cfg, act=launch_rank() == 0)
        except ConfigError as error:  # one line (with cause=config under a launcher: SLURM does not requeue it)
            from grpo_mega.config import GRPOConfig, SFTConfig
            from grpo_mega.config.loading import another_commands_config

            error = another_commands_config(error, {"grpo-mega train": GRPOConfig, "grpo-mega sft": SFTConfig})
            if launched:
                from grpo_mega.run.failure import report_failure

                report_failure("grpo-mega prm train", None, error)
            else:
                print(f"grpo-mega prm train: error: {error}", file=sys.stderr)
            return 2
        announce_verdict("grpo-mega prm train", verdict)
        if verdict.complete:
            if not launched:
                print(verdict.checkpoint, flush=True)  # the output path, as a run that trains prints it last
                return 0
        if not launched:
            from grpo_mega.run.progress import announce_start

            announce_start("grpo-mega prm train", nproc, ["the PRM"])
    else:
        nproc = args.nproc or _default_nproc(args)
        if not under_launcher():  # in the command's own process, before torch's import (seconds) and any rank
            check_prm_arguments(args)
            if args.prm_command == "label":
                from grpo_mega.run.progress import announce_start

                announce_start("grpo-mega prm label", nproc, ["the policy"], then="a line per phase follows",
                               out=sys.stderr)  # where its phase lines go
    if nproc > 1 and not under_launcher():
        return relaunch_with_torchrun(nproc, ["grpo_mega.cli", *argv])
    # after the checks (they stay torch-free), as grpo_mega.cli's _run_training: the work below imports torch, and a
    # Ctrl-C in torch's import was lost (grpo_mega.run.interrupts); a no-op in a rank forked with torch preloaded
    import_torch_holding_ctrl_c()
    if args.prm_command == "train":
        from grpo_mega.run.control import EXIT_STOPPED_EARLY, StoppedEarly
        from grpo_mega.run.reaper import reap_group_when_rank_exits
        from prm.train import run_prm_train

        reap_group_when_rank_exits()  # the rank's helper processes end with it, however it ends
        try:
            output = run_prm_train(cfg)
        except StoppedEarly as stopped:  # a checkpoint was saved; the same command resumes (exit status 3)
            print(f"grpo-mega prm train: {stopped}", file=sys.stderr)
            return EXIT_STOPPED_EARLY
        except (Exception, KeyboardInterrupt) as error:  # one line; the traceback in failure.json and tracebacks/
            from grpo_mega.run.failure import exit_status, report_failure

            return exit_status(report_failure("grpo-mega prm train", cfg.trainer.run_dir, error))
    elif args.prm_command == "label":
        from prm.label_command import run_label

        output = run_label(args)
    elif args.prm_command == "score":
        from prm.scoring import run_score

        output = run_score(args)
    else:
        from prm.eval_command import run_eval

        output = run_eval(args)
    if _is_rank0():
        print(output, flush=True)
    return 0


LABEL_COUNTS = ("n", "samples_per_prompt", "max_new_tokens", "generation_batch_size", "tp", "prompt_length")
"""``prm label``'s counts that must be >= 1 (``--max-prompts``: grpo_mega.cli's count check)."""


def check_prm_flags(args) -> None:
    """What ``prm label / eval`` can tell from their flags alone: ValueError naming the flag for a ``label`` count
    below 1, an ``eval`` given neither ``--data`` nor ``--policy``, or ``--policy`` without ``--prompts``. The ranks
    check the same again (``run_label``, ``run_eval``: a job started under torchrun or srun skips this process)."""
    if args.prm_command == "label":
        for name in LABEL_COUNTS:
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    elif args.prm_command == "eval":
        if args.data is None and args.policy is None:
            raise ValueError("give --data (step-labelled rows) and/or --policy with --prompts (best-of-N)")
        if args.policy is not None and args.prompts is None:
            raise ValueError("--policy needs --prompts (prompts with gold answers)")


def check_prm_arguments(args) -> None:
    """What ``prm label / score / eval`` can tell from their flags and paths alone, without torch: ValueError naming
    the flag for a bad count or a missing input (:func:`check_prm_flags`), a model path that is no model (``--prm``,
    ``--policy``, ``--completer``), a causal LM as ``--prm`` without ``--layout``, and for ``score`` a ``--data``
    file that is no step-labelled data (read as the ranks read it)."""
    from grpo_mega.checkpoint.training_files import find_checkpoint_folder, weights_format
    from prm.spec import check_layout_is_known

    check_prm_flags(args)
    for flag in ("prm", "policy", "completer"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        try:
            if weights_format(path) in ("training_checkpoint", "training_run"):
                find_checkpoint_folder(path)
        except ValueError as error:
            raise ValueError(f"--{flag} {path}: {str(error).removeprefix('init_from: ')}") from None
    if getattr(args, "prm", None) is not None and args.layout is None:
        check_layout_is_known(args.prm, "--layout")
    if args.prm_command == "score":
        from prm.scoring import read_data

        read_data(args)


def _is_rank0() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0
