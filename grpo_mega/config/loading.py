"""Loading a run config: the schema's defaults, a YAML file and ``key=value`` overrides merged by OmegaConf, which
checks them against the dataclasses, so an unknown key or a value of the wrong type fails at start-up with the key
named (and, for a near miss, the key meant); then the schema's own checks (``validator``).

An override of a text key (``str`` or ``Optional[str]`` in the schema) takes its value as written:
``process_reward.answer_pattern=#### -?\\d+`` is that regex, not a YAML comment (null), and ``[.!?]\\s`` is not a
YAML list; ``key=null`` still unsets it and a quoted value is unquoted. Other values are read as YAML (numbers,
booleans, lists), and one that does not parse is one line naming its key."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message names the key."""


class UnknownKeyError(ConfigError):
    """A key the schema does not have (``key``); ``source`` is the config file's path, or None for an override."""

    def __init__(self, message: str, key: str, source: str | None):
        super().__init__(message)
        self.key, self.source = key, source


def another_commands_config(error: ConfigError, schemas: dict[str, type]) -> ConfigError:
    """``error`` itself, or, when it is an unknown key of a config file whose keys all belong to the schema of
    another command (``schemas``: {command: schema}), a ConfigError that names that command: an SFT or PRM config
    given to ``grpo-mega train`` is a mix-up of commands, not a broken config."""
    if not isinstance(error, UnknownKeyError) or error.source is None:
        return error
    for command, schema in schemas.items():
        try:
            merge_config(schema, error.source)
        except UnknownKeyError:
            continue
        except ConfigError:  # its keys are that schema's; a value is off, which that command will say
            pass
        return ConfigError(f"{error.source}: this looks like a `{command}` config (its keys, {error.key} among them, "
                           f"are that command's): run `{command} --config {error.source}`")
    return error


def load_config(schema: type, path: str | Path | None, overrides: list[str] = (), validator=None) -> Any:
    """Merge ``schema`` defaults, the YAML file and ``key=value`` overrides; return the typed config object.

    Raises ConfigError naming the file and key for unknown keys (with the nearest known key), wrong types, missing
    required values, a YAML syntax error (``file:line:column``) and an override without ``=``.
    """
    merged = merge_config(schema, path, overrides)
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"required config keys not set: {', '.join(missing)}")
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"command-line overrides: bad config key {getattr(error, 'full_key', None)!r}: "
                          f"{str(error).splitlines()[0]}") from None
    if validator is not None:
        validator(cfg)
    return cfg


def merge_config(schema: type, path: str | Path | None, overrides: list[str] = ()):
    """``schema``'s defaults, the YAML file and the overrides merged (an OmegaConf node; required keys not set are
    ``???`` in it); ConfigError as :func:`load_config`'s for what cannot be merged."""
    overrides = list(overrides)
    check_overrides(overrides)
    base = OmegaConf.structured(schema)
    source, typed = "defaults", []
    try:
        if path is not None:
            source = str(path)
            loaded = read_yaml(path)
            typed = _leaf_keys(loaded)
            base = OmegaConf.merge(base, loaded)
        source = "command-line overrides"
        typed = [item.split("=", 1)[0].strip() for item in overrides]
        return OmegaConf.merge(base, overrides_node(schema, overrides))
    except ConfigKeyError as error:
        key = str(getattr(error, "full_key", None) or "")
        key = _typed_key(key, typed)
        raise UnknownKeyError(f"{source}: unknown config key {key!r}{did_you_mean(key, schema)}", key,
                              str(path) if source != "command-line overrides" else None) from None
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        reason = str(error).splitlines()[0]
        raise ConfigError(f"{source}: bad config key {key!r}: {reason}") from None


REQUIRED_NOT_SET = "  # required, not set"
"""What ``--print-config`` writes after a required key that is not set (its value printed as ``???``)."""


def printable_config(schema: type, path: str | Path | None, overrides: list[str] = (),
                     validator=None) -> tuple[str, list[str]]:
    """What ``--print-config`` prints: (the resolved config as YAML, the required keys not set, sorted). A config
    whose required keys are not set yet is shown, not refused: each of them printed as ``???`` followed by
    :data:`REQUIRED_NOT_SET`; the checks that need every value (``validator``) run on a complete config only.
    ConfigError for what :func:`load_config` refuses otherwise (unknown keys, wrong types, YAML errors)."""
    merged = merge_config(schema, path, overrides)
    missing = sorted(OmegaConf.missing_keys(merged))
    if not missing:
        return config_yaml(load_config(schema, path, overrides, validator)), []
    return mark_required_not_set(OmegaConf.to_yaml(merged), missing), missing


def mark_required_not_set(text: str, keys: list[str]) -> str:
    """``text`` (block YAML as OmegaConf writes it, two spaces per level) with :data:`REQUIRED_NOT_SET` after the
    line of each dotted key of ``keys`` whose value is ``???``."""
    wanted, path, lines = set(keys), [], []
    for line in text.splitlines():
        name, colon, value = line.strip().partition(":")
        if colon and not line.lstrip().startswith(("-", "#")):
            depth = (len(line) - len(line.lstrip())) // 2
            path[depth:] = [name]
            if value.strip() == "???" and ".".join(path) in wanted:
                line += REQUIRED_NOT_SET
        lines.append(line)
    return "\n".join(lines) + "\n"


def check_overrides(overrides: list[str]) -> None:
    """Every override is ``key=value`` (OmegaConf would set a bare ``key`` to null without a word)."""
    for item in overrides:
        key, equals, _ = item.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value: write {item}=VALUE "
                              f"({item}=null to unset it)" if not equals else f"override {item!r} names no key")


def overrides_node(schema: type, overrides: list[str]):
    """The overrides as one OmegaConf node: a text key's value as written (module docstring), any other read as
    YAML; ConfigError naming the key of a value that does not parse."""
    import yaml

    node = OmegaConf.create()
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""
        if value != "null" and not quoted and _text_key(schema, key):
            OmegaConf.update(node, key, value, merge=True)
            continue
        if not quoted and "," in value and not value.lstrip().startswith("[") and _list_key(schema, key):
            item = f"{key}=[{value}]"  # `tree_rollout.branching=2,2,2`: the list meant, as Hydra reads it
        try:
            node = OmegaConf.merge(node, OmegaConf.from_dotlist([item]))
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ConfigError(f"override {key}={value}: the value is not valid YAML ({problem}): quote it, "
                              f"'{key}=\"...\"'") from None
    return node


def _text_key(schema: type, key: str) -> bool:
    """Whether ``key`` (dotted) names a ``str`` or ``Optional[str]`` field of the dataclass ``schema``."""
    return _field_type(schema, key) is str


def _list_key(schema: type, key: str) -> bool:
    """Whether ``key`` (dotted) names a list field (``list[int]``, ``Optional[list[str]]``) of ``schema``."""
    return typing.get_origin(_field_type(schema, key)) is list


def _field_type(schema: type, key: str) -> Any:
    """The type of the dotted field ``key`` of the dataclass ``schema``, ``Optional`` taken off; None when there is
    no such field."""
    kind: Any = schema
    for part in key.split("."):
        if not dataclasses.is_dataclass(kind):
            return None
        fields = {f.name for f in dataclasses.fields(kind)}
        if part not in fields:
            return None
        kind = typing.get_type_hints(kind)[part]
        arguments = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(arguments) == 1:
            kind = arguments[0]
    return kind


def read_yaml(path: str | Path):
    """The YAML file ``path`` as an OmegaConf node; ConfigError for a missing file, or a syntax error named by
    ``file:line:column`` in one line."""
    import yaml

    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from None


def _leaf_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys of every leaf (and section) of an OmegaConf mapping."""
    keys = []
    if OmegaConf.is_dict(node):
        for name in node.keys():
            dotted = f"{prefix}{name}"
            keys.append(dotted)
            child = node._get_node(name)
            if OmegaConf.is_dict(child):
                keys += _leaf_keys(child, dotted + ".")
    return keys


def _typed_key(key: str, typed: list[str]) -> str:
    """The key as the user wrote it: OmegaConf names only the first unknown part (``trainerx`` of
    ``trainerx.total_steps``)."""
    longer = [name for name in typed if name == key or name.startswith(key + ".")]
    return max(longer, key=len) if longer else key


def did_you_mean(key: str, schema: type) -> str:
    """``": did you mean trainer.total_steps?"`` for the schema key nearest ``key``; for a verl or TRL key, its
    grpo-mega key (``grpo_mega.config.peer_keys``); or ``""``."""
    from grpo_mega.config.peer_keys import peer_key_hint

    known = _leaf_keys(OmegaConf.structured(schema))
    hint = peer_key_hint(key, set(known))
    if hint:
        return hint
    match = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f": did you mean {match[0]}?" if match else ""


def config_yaml(cfg: Any) -> str:
    """The resolved config as YAML: every key, defaults filled in (what ``--print-config`` prints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config next to the run's outputs, so a run can be reproduced and resumed."""
    Path(path).write_text(config_yaml(cfg))
