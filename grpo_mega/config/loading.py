"""Loading a run config: the schema's defaults, a YAML file and ``key=value`` overrides merged by OmegaConf, which
checks them against the dataclasses, so an unknown key or a value of the wrong type fails at start-up with the key
named; then the schema's own checks (``validator``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration file or override that cannot be used; the message names the key."""


def load_config(schema: type, path: str | Path | None, overrides: list[str] = (), validator=None) -> Any:
    """Merge ``schema`` defaults, the YAML file and ``key=value`` overrides; return the typed config object.

    Raises ConfigError naming the file and key for unknown keys, wrong types and missing required values.
    """
    base = OmegaConf.structured(schema)
    source = "defaults"
    try:
        if path is not None:
            source = str(path)
            if not Path(path).is_file():
                raise ConfigError(f"config file {path} does not exist")
            base = OmegaConf.merge(base, OmegaConf.load(path))
        source = "command-line overrides"
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"required config keys not set: {', '.join(missing)}")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None)
        reason = str(error).splitlines()[0]
        raise ConfigError(f"{source}: bad config key {key!r}: {reason}") from None
    if validator is not None:
        validator(cfg)
    return cfg


def config_yaml(cfg: Any) -> str:
    """The resolved config as YAML: every key, defaults filled in (what ``--print-config`` prints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config next to the run's outputs, so a run can be reproduced and resumed."""
    Path(path).write_text(config_yaml(cfg))
