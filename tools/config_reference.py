"""Write the config reference (docs/reference/*.md) from the config schema: every key of the GRPO, SFT and PRM
configs with its type, default, allowed values and description, one page per config kind.

    python tools/config_reference.py           # (re)write docs/reference/
    python tools/config_reference.py --check   # exit 1 naming the stale pages (CI: tests/test_docs.py)

The schema is the dataclasses themselves (``grpo_mega.config.GRPOConfig``, ``SFTConfig``, ``prm.config.PRMConfig``);
a key's description is the docstring under its field in the source (the nearest class of the MRO that has one), a
section's the docstring of its class; allowed values come from the ``check_choice(value, CHOICES, "key")`` calls of
the config checks, read from their source, so the page lists what the validation really accepts.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OUT = REPO / "docs" / "reference"
KINDS = {  # page -> (schema "module:Class", the command that reads it, what it is)
    "grpo": ("grpo_mega.config:GRPOConfig", "grpo-mega train", "GRPO training (outcome and process supervision)"),
    "sft": ("grpo_mega.config:SFTConfig", "grpo-mega sft", "supervised fine-tuning"),
    "prm": ("prm.config:PRMConfig", "grpo-mega prm train", "process reward model training"),
}
CHECK_MODULES = (
    "grpo_mega.config.checks", "grpo_mega.config.cross_field", "grpo_mega.config.turn_checks", "prm.config",
)


@dataclasses.dataclass
class Key:
    name: str
    type: str
    default: str
    choices: str
    description: str


def _field_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its annotated assignment, for ``cls`` and its bases (the
    nearest class first)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for statement, following in zip(body, body[1:] + [None]):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                        and isinstance(following.value.value, str)):
                    docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def allowed_values() -> dict[str, tuple]:
    """Dotted key -> the values ``check_choice`` accepts for it, from the calls in the config checks."""
    choices: dict[str, tuple] = {}
    for module_name in CHECK_MODULES:
        module = importlib.import_module(module_name)
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_choice"
                    and len(node.args) == 3 and isinstance(node.args[2], ast.Constant)):
                values = eval(compile(ast.Expression(node.args[1]), module_name, "eval"), vars(module))  # noqa: S307
                choices[node.args[2].value] = tuple(values)
    return choices


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _format_value(value: Any) -> str:
    if value == "???":
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def collect(cls: type, choices: dict[str, tuple], prefix: str = "") -> list[tuple[str, str, list[Key]]]:
    """Sections of ``cls`` in field order: (dotted section name, section description, its leaf keys)."""
    docs = _field_docstrings(cls)
    leaves, sections = [], []
    for field in dataclasses.fields(cls):
        name = f"{prefix}{field.name}"
        default = _default(field)
        if dataclasses.is_dataclass(default):
            section_doc = docs.get(field.name) or inspect.cleandoc(type(default).__doc__ or "")
            if section_doc.startswith(f"{type(default).__name__}("):  # dataclass's generated signature
                section_doc = ""
            for sub_name, sub_doc, keys in collect(type(default), choices, f"{name}."):
                sections.append((sub_name or name, sub_doc if sub_name else section_doc, keys))
            continue
        allowed = choices.get(name, ())
        leaves.append(Key(name=name, type=_type_name(str(field.type)),
                          default=_format_value(default), choices=", ".join(_format_value(v) for v in allowed),
                          description=docs.get(field.name, "")))
    return [("", "", leaves)] + sections if leaves else sections


def _type_name(annotation: str) -> str:
    """``Optional[int]`` -> ``int or null``; other annotations as written."""
    if annotation.startswith("Optional[") and annotation.endswith("]"):
        return f"{annotation[len('Optional['):-1]} or null"
    return annotation


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(page: str) -> str:
    """The markdown page of one config kind."""
    target, command, what = KINDS[page]
    module_name, class_name = target.split(":")
    schema = getattr(importlib.import_module(module_name), class_name)
    lines = [f"# {class_name}: {what}", "",
             f"The keys of `{command} --config FILE [key=value ...]`, generated from the schema "
             f"(`{module_name}.{class_name}`) by `python tools/config_reference.py`; do not edit by hand. "
             f"`{command} --config FILE --print-config` prints the config a run would use, defaults filled in.", ""]
    for section, description, keys in collect(schema, allowed_values()):
        lines += [f"## `{section}`" if section else "## top level", ""]
        if description:
            lines += [_cell(description), ""]
        lines += ["| key | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
        for key in keys:
            lines.append(f"| `{key.name}` | {_cell(key.type)} | `{_cell(key.default)}` | "
                         f"{_cell(key.choices) or ''} | {_cell(key.description)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def undocumented() -> list[str]:
    """Every key of every config kind without a description."""
    missing = []
    for page in KINDS:
        target = KINDS[page][0]
        module_name, class_name = target.split(":")
        schema = getattr(importlib.import_module(module_name), class_name)
        for _, _, keys in collect(schema, allowed_values()):
            missing += [f"{class_name}: {key.name}" for key in keys if not key.description.strip()]
    return missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/reference/ instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for page in KINDS:
        path = OUT / f"{page}.md"
        text = render(page)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(REPO)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    if stale:
        print(f"stale config reference: {', '.join(stale)}; run python tools/config_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
