"""What a command checks in its own process before it starts any rank (``grpo-mega train``, ``sft``, ``eval``,
``prm train``): the config loaded and validated against the job's process count, the paths it names, a GRPO run's
prompt files (every row's fields, each file in its own format), and the run folder (``grpo_mega.run.folder``: never
two runs mixed in one). A mistake is one :class:`ConfigError` naming the key;
the commands print it as one line and exit 2 before torchrun starts anything. Under a launcher (torchrun, srun)
every rank checks the same before it builds anything, so a job started without the CLI's own check is refused too
(the prompt files' rows excepted: the ranks' loader refuses the same rows with the same words, cause ``data``).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from grpo_mega.config.loading import ConfigError, load_config, printable_config
from grpo_mega.data.sources import DataSourceError, resolve_source
from grpo_mega.run.failure import set_aside_failure
from grpo_mega.run.folder import RunFolderError, RunFolderVerdict, check_run_folder
from grpo_mega.run.launcher import under_launcher


def load_checked(schema: type, validator: Callable, path: str, overrides: list[str], *,
                 world_size: int | None) -> Any:
    """The config of ``path`` and ``overrides``, validated (``validator(cfg, world_size=...)``) for a job of
    ``world_size`` processes (None: the launcher's; 0: not known) and with its paths checked; outside a launcher
    a GRPO config's prompt files too (:func:`check_prompt_files`)."""
    cfg = load_config(schema, path, overrides, functools.partial(validator, world_size=world_size))
    check_paths(cfg)
    if hasattr(cfg.data, "eval_format") and not under_launcher():  # a GRPO config, in the command's own process
        check_prompt_files(cfg)
        check_reward_on_rows(cfg)
        check_tool_specs(cfg)
        check_agent_rows(cfg)
    return cfg


def check_tool_specs(cfg: Any) -> None:
    """``rollout.multi_turn.tools`` of an enabled multi-turn config, checked without starting any process
    (``grpo_mega.tools.check_tool_specs``: a typo, a module that does not import, a name that is not callable):
    ConfigError naming the key and the spec."""
    multi_turn = getattr(getattr(cfg, "rollout", None), "multi_turn", None)
    if multi_turn is None or not multi_turn.enable:
        return
    from grpo_mega.tools import check_tool_specs as check

    try:
        check(list(multi_turn.tools))
    except ValueError as error:
        raise ConfigError(f"rollout.multi_turn.tools: {error}") from None


def print_config(command: str, schema: type, validator: Callable, path: str, overrides: list[str]) -> None:
    """``--print-config``: the resolved config on stdout, checked by ``validator`` (not the paths, nor the run
    folder); required keys not set yet are marked in it (``???  # required, not set``) and named in one line on
    stderr instead of refused. ConfigError for anything else a run would refuse."""
    text, missing = printable_config(schema, path, overrides, validator)
    print(text, end="")
    if missing:
        print(f"{command}: required keys not set (marked in the config above): {', '.join(missing)}",
              file=sys.stderr)


def check_paths(cfg: Any) -> None:
    """The folders and files a run reads exist: ``model.hf_config`` (with its config.json), ``model.tokenizer``,
    ``model.init_from``, ``data.train_file`` / ``data.eval_file``, a PRM's ``process_reward.prm``, an implicit PRM's
    ``implicit_prm.init_from``."""
    model = cfg.model
    hf_config = Path(model.hf_config)
    if not hf_config.is_dir():
        raise ConfigError(f"model.hf_config={model.hf_config}: no such folder (the Hugging Face folder holding the "
                          "model's config.json)")
    if not (hf_config / "config.json").is_file():
        raise ConfigError(f"model.hf_config={model.hf_config} holds no config.json (the Hugging Face config of the "
                          "architecture)")
    if model.tokenizer is not None and not Path(model.tokenizer).is_dir():
        raise ConfigError(f"model.tokenizer={model.tokenizer}: no such folder (null: the tokenizer of "
                          "model.hf_config)")
    if model.init_from is not None and not Path(model.init_from).exists():
        raise ConfigError(f"model.init_from={model.init_from}: no such folder (an HF folder, a converted megatron "
                          "folder, a grpo-mega checkpoint or run directory; null: random weights)")
    if model.init_from is not None:
        check_weights_folder("model.init_from", model.init_from)
        if not under_launcher() and not hasattr(cfg, "prm"):  # a policy's run (a PRM's may start from a PRM)
            note_prm_as_policy("model.init_from", model.init_from)
    for key in ("train_file", "eval_file"):
        value = getattr(cfg.data, key, None)
        if value is not None:
            try:
                resolve_source(value)
            except (FileNotFoundError, DataSourceError) as error:
                raise ConfigError(f"data.{key}={value}: {str(error).removeprefix(f'{value}: ')}") from None
    process_reward = getattr(cfg, "process_reward", None)
    if process_reward is not None and process_reward.source == "prm" and not Path(process_reward.prm).exists():
        raise ConfigError(f"process_reward.prm={process_reward.prm}: no such folder (a grpo-mega PRM checkpoint or run "
                          "directory, or a Hugging Face PRM folder)")
    implicit = getattr(cfg, "implicit_prm", None)
    if process_reward is not None and process_reward.source == "implicit" and implicit.init_from is not None:
        if not Path(implicit.init_from).exists():
            raise ConfigError(f"implicit_prm.init_from={implicit.init_from}: no such folder (what model.init_from "
                              "takes; null: model.init_from)")
        check_weights_folder("implicit_prm.init_from", implicit.init_from)


def check_prompt_files(cfg: Any) -> None:
    """A GRPO config's prompt files (``data.train_file``, ``data.eval_file``), each read with its own format
    (``data.format`` / ``data.eval_format``; ``auto``: detected from its own rows) and every row's fields checked, as
    the ranks' loader checks them but without a tokenizer (a prompt over ``data.prompt_length`` tokens is the ranks'
    to find). ConfigError naming the key, the file, the row and the field when the first bad row stops the run
    (``data.on_bad_row=error``) or no row is usable (without a chat template, a conversation of more than one turn is
    not), and for a file of conversations with ``data.chat_template=true`` and a tokenizer without a chat template:
    every file's problems in one message. For a usable file one line on stderr only where its rows won over the
    config's field keys (the layout's note: what was read instead); the ranks' loader logs the rows it skips."""
    from grpo_mega.data.formats import field_settings
    from grpo_mega.data.prompt_rows import BadRowError, scan_prompt_file
    from grpo_mega.data.tokenizer import has_chat_template

    tokenizer = cfg.model.tokenizer or cfg.model.hf_config
    templated = cfg.data.chat_template is not False and has_chat_template(tokenizer)
    problems = []  # every file's, in one message: not one refusal per run of the command
    for key in ("train_file", "eval_file"):
        path = getattr(cfg.data, key)
        if path is None:
            continue
        try:
            scan = scan_prompt_file(path, field_settings(cfg.data, eval_file=key == "eval_file"), cfg.data.on_bad_row,
                                    one_turn=not templated and cfg.data.chat_template is not True)
        except (BadRowError, DataSourceError, FileNotFoundError) as error:
            problems.append(f"data.{key}={path}: {error}")
            continue
        if scan.layout.note:
            print(f"data.{key}={path}: {scan.layout.note}", file=sys.stderr)
        if scan.layout.conversation and cfg.data.chat_template and not templated:
            problems.append(f"data.{key}={path} holds conversations ({scan.layout.describe()}) and "
                            f"data.chat_template=true, but the tokenizer in {tokenizer} has no chat template: set "
                            "data.chat_template=null (a one-turn conversation is then given as its text) or "
                            "model.tokenizer to a tokenizer folder that has one")
    if problems:
        raise ConfigError("; and ".join(problems))


def check_weights_folder(key: str, folder: str) -> None:
    """ConfigError naming ``key`` when ``folder`` holds none of the weight formats a run starts from, or is a run
    directory without a complete checkpoint (what the ranks would find only after building the model)."""
    from grpo_mega.checkpoint.training_files import find_checkpoint_folder, weights_format

    try:
        if weights_format(folder) in ("training_checkpoint", "training_run"):
            find_checkpoint_folder(folder)
    except ValueError as error:
        raise ConfigError(f"{key}={folder}: {str(error).removeprefix('init_from: ')}") from None


def note_prm_as_policy(key: str, path: str) -> None:
    """One line on stderr when the weights a policy starts from (``key``: ``model.init_from``, ``--policy``) are a
    PRM's (a ``grpo-mega prm train`` checkpoint, an HF process reward model): it is loaded as a policy all the same,
    which is what a user who mixed up two run folders would not expect to pass in silence."""
    from grpo_mega.checkpoint.source import model_path_summary

    try:
        _, run_config, hf_config = model_path_summary(path)
    except (ValueError, OSError):
        return
    prm = (run_config or {}).get("prm") or {}
    architectures = (hf_config or {}).get("architectures") or []
    if prm.get("layout"):
        what = f"a PRM checkpoint (grpo-mega prm train, layout {prm['layout']})"
    elif any("ProcessRewardModel" in name for name in architectures):
        what = f"a process reward model ({architectures[0]})"
    else:
        return
    print(f"note: {key}={path} is {what}, loaded here as the policy: a PRM's weights generate as the LM they started "
          "from at best; name the policy's checkpoint if that was meant", file=sys.stderr)


def check_policy_vocabulary(cfg: Any, policy: str, key: str = "--policy") -> None:
    """ConfigError when the policy at ``policy`` has another vocabulary size than ``model.hf_config``'s config.json:
    a policy of another model than the config's, which ``train`` refuses (its weights do not fit the config's model)
    and ``eval`` scored 0.000 without a word. Read without transformers (``model_path_summary``)."""
    import json

    from grpo_mega.checkpoint.source import model_path_summary

    config_file = Path(cfg.model.hf_config) / "config.json"
    try:
        _, _, policy_config = model_path_summary(policy)
        ours = json.loads(config_file.read_text()).get("vocab_size")
    except (ValueError, OSError):
        return  # what cannot be read here is the loader's to report
    theirs = (policy_config or {}).get("vocab_size")
    if ours is not None and theirs is not None and ours != theirs:
        raise ConfigError(f"{key} {policy} has a vocabulary of {theirs} tokens and model.hf_config="
                          f"{cfg.model.hf_config} one of {ours}: a policy of another model than the config's (train "
                          f"refuses this pair); set model.hf_config to the policy's own config folder")


def start_attempt(cfg: Any, *, act: bool = True) -> RunFolderVerdict:
    """Before a training command starts its ranks: the run folder guard (``grpo_mega.run.folder``; with ``act``
    an earlier run that ``trainer.overwrite`` replaces is moved aside), then, with ``act``, an earlier attempt's
    failure.json set aside so that the folder names this attempt's cause or none. ConfigError for a folder that
    holds another run."""
    try:
        verdict = check_run_folder(asdict(cfg), act=act)
    except RunFolderError as error:
        raise ConfigError(str(error)) from None
    if act and not verdict.complete:
        set_aside_failure(cfg.trainer.run_dir)
    return verdict


def announce_verdict(command: str, verdict: RunFolderVerdict) -> None:
    """Say on stderr what the run folder guard did (an earlier run moved aside) or found (the run is complete: once,
    from rank 0 of a job)."""
    if verdict.moved_to is not None:
        print(f"{command}: trainer.overwrite=true: moved the earlier run aside to {verdict.moved_to}", file=sys.stderr)
    if verdict.complete and launch_rank() == 0:
        print(f"{command}: {verdict.message}", file=sys.stderr)


def launch_rank() -> int:
    """This process's rank in a job its launcher started (torchrun's RANK, srun's SLURM_PROCID); 0 otherwise."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


REWARD_CHECK_ROWS = 3
"""Rows of the train file that ``check_reward_on_rows`` scores before launch."""


def check_reward_on_rows(cfg: Any, rows: int = REWARD_CHECK_ROWS) -> None:
    """Call every reward function of a GRPO config (``reward.function`` / ``reward.functions``, the weighted
    ``reward.format_function``) on the first ``rows`` rows of ``data.train_file`` with two made-up completions
    (the row's answer said plainly, and an empty one), as the ranks will call it: a function with the wrong
    signature, a column the rows lack, a verl_default ``data_source`` it has no verifier for, or a return value
    that is no reward fails here, in the command's own process, instead of at every step of a launched run (where
    ``reward.on_error=zero`` would train on zeros). A None (TRL: not applicable) is accepted. ConfigError naming the
    key, the function, the row (file:line) and the error. Configs without rewards (SFT) are not checked."""
    reward, data = getattr(cfg, "reward", None), getattr(cfg, "data", None)
    if reward is None or data is None or not getattr(data, "train_file", None):
        return
    from grpo_mega.reward.adapters import reward_rows_of
    from grpo_mega.reward.compute import check_result
    from grpo_mega.reward.registry import get_reward_function, reward_specs

    named = [("reward.functions" if reward.functions else "reward.function", spec)
             for spec, _ in reward_specs(reward.function, reward.functions, reward.weights)]
    if reward.format_weight:
        named.append(("reward.format_function", reward.format_function))
    layout, functions = reward_rows_of(data), []
    for key, spec in named:
        try:
            functions.append((key, spec, get_reward_function(spec, layout)))
        except (ImportError, AttributeError, TypeError, ValueError) as error:
            raise ConfigError(f"{key}: {error}") from None
        except Exception as error:  # its module raised on import
            raise ConfigError(f"{key}={spec}: importing it raised {type(error).__name__}: {error}") from None
    process = getattr(cfg, "process_reward", None)
    by_turns = (process is not None and process.steps == "turns" and process.source == "function"
                and cfg.algorithm.supervision == "process")
    for location, prompt, answer, extra in _first_rows(data, rows):
        for completion in (f"The answer is {answer}.", ""):
            for key, spec, function in functions:
                # process_reward.steps=turns: the reward function is given the turns (here one answer turn, or none)
                turns = [{"text": completion, "start": 0, "end": len(completion), "ended": "answer",
                          "calls": []}] if completion else []
                given = {**extra, "turns": turns} if by_turns and key != "reward.format_function" else extra
                try:
                    value = function(prompt, completion, answer, **given)
                    problem = None if value is None else check_result(value, len(completion))
                except Exception as error:
                    problem = f"{type(error).__name__}: {error}"
                if isinstance(problem, str):
                    raise ConfigError(f"{key}={spec} cannot score {location} (completion {completion!r:.40}): "
                                      f"{problem} (the row's other columns: {sorted(extra)})")


TOOL_AGENTS = ("tool_agent",)
"""verl's ``agent_name`` values whose rows call tools (its ``single_turn_agent`` rows do not)."""


def check_agent_rows(cfg: Any, rows: int = REWARD_CHECK_ROWS) -> None:
    """ConfigError naming the row when one of the first ``rows`` rows of ``data.train_file`` asks for verl's tool
    agent (``agent_name: tool_agent``) and ``rollout.multi_turn`` is off: the run would train those rows with one
    completion each, no tool ever called, and say nothing."""
    multi_turn = getattr(getattr(cfg, "rollout", None), "multi_turn", None)
    if multi_turn is None or multi_turn.enable or not getattr(cfg.data, "train_file", None):
        return
    for location, _, _, extra in _first_rows(cfg.data, rows):
        if extra.get("agent_name") in TOOL_AGENTS:
            raise ConfigError(f"data.train_file {location}: agent_name {extra['agent_name']!r} asks for verl's tool "
                              "agent loop: set rollout.multi_turn.enable=true and rollout.multi_turn.tools (e.g. "
                              "[python] or path/to/file.py:function)")


def _first_rows(data: Any, count: int):
    """(file:line, prompt, answer, other columns) of the first ``count`` usable rows of ``data.train_file``, read
    with its layout as the ranks read it (``grpo_mega.data.prompt_rows``)."""
    from grpo_mega.data.formats import field_settings
    from grpo_mega.data.prompt_rows import usable_rows

    yield from usable_rows(data.train_file, field_settings(data), count)
