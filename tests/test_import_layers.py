"""The house's import rules, read from the source with ``ast`` (no third-party tool, nothing imported):

- every module of ``grpo_mega/`` and ``prm/`` belongs to one layer of ``LAYERS`` (a new module must be placed);
- no module imports from a layer above its own;
- no import circle among the modules;
- no module is over ``MAX_LINES`` lines.

Every import statement counts: module level, inside functions (lazy imports), under ``if TYPE_CHECKING:``, and
relative forms (``from . import x``, ``from ..engine import base``). ``from package import name`` is an import of
``package.name`` when that is a module, else of the package (its ``__init__``). Importing ``a.b.c`` also runs
``a/__init__`` and ``a/b/__init__``; those implicit imports are not counted (every module would import its
package's ``__init__``), so a package's ``__init__`` is placed by what it imports like any other module.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("grpo_mega", "prm")
MAX_LINES = 450

# Lowest first. A module belongs to the layer of the longest prefix that names it or one of its parent packages;
# a module may import from its own layer (circles are caught below) and from any layer below it.
# A run's life is two layers: ``run`` (launching, the run folder's names, the metrics log, stop requests, failure
# records, the watchdog: plumbing that checkpoint/ and rollout/ use too) sits below the model and the engines, and
# ``harness`` (the shared life cycle of a training run and resume) above the engines, checkpoints and config, beside
# the trainers it serves.
# The direction between the two packages: prm builds on grpo_mega's infrastructure (process groups, model, data,
# checkpoints, engines) and run config; grpo_mega's harness, trainers, GRPO step and commands sit above prm's library,
# because process-supervised GRPO scores steps with a PRM and the planner and CLIs know it. The config reads only the
# PRM's spec (which layout a path holds), which sits below it and needs nothing above the checkpoint layer.
LAYERS: list[tuple[str, frozenset[str]]] = [
    ("package roots: a docstring and a version, no imports",
     frozenset({"grpo_mega", "prm"})),
    ("pure code: the GRPO math, memory figures and start-up clocks",
     frozenset({"grpo_mega.algo", "grpo_mega.perf"})),
    ("process groups and the launch environment",
     frozenset({"grpo_mega.parallel"})),
    ("a run's life below the engines: launching, the run folder's names, metrics log, stop requests, failure "
     "records, watchdog, reaper, command runner, library warnings",
     frozenset({"grpo_mega.run"})),
    ("the Megatron GPT model and its LoRA adapters, datasets, tokenizers and batch layout, reward functions, the "
     "tools' sandbox",
     frozenset({"grpo_mega.model", "grpo_mega.lora", "grpo_mega.data", "grpo_mega.reward", "grpo_mega.tools"})),
    ("weights on disk: Hugging Face conversion, converted folders, training checkpoints",
     frozenset({"grpo_mega.checkpoint"})),
    ("engines that hold a model on the devices: training, forward-only, rollout (generation)",
     frozenset({"grpo_mega.engine", "grpo_mega.rollout"})),
    ("what a PRM is, read from disk without an engine: its examples, rendering contract and spec (layout)",
     frozenset({"prm.examples", "prm.rendering", "prm.spec", "prm.turn_steps", "prm.turn_rendering"})),
    ("the typed run config (it checks the layout of the PRM a GRPO config names)",
     frozenset({"grpo_mega.config"})),
    ("the PRM library on grpo_mega's infrastructure: heads, data, engines, opening, scoring, labels, metrics",
     frozenset({"prm.metrics", "prm.data", "prm.synthetic", "prm.heads", "prm.hf_model", "prm.engines",
                "prm.model", "prm.config", "prm.scoring", "prm.policy", "prm.labeling", "prm.perturb",
                "prm.evaluate", "prm.best_of_n", "prm.vllm_scoring", "prm.export", "prm.turn_labeling",
                "prm.turn_setup"})),
    ("a training run's life above the engines: the run harness and resume (what each trainer's checkpoint holds)",
     frozenset({"grpo_mega.harness"})),
    ("the trainers and the GRPO step (its stages read PRM step rewards from the PRM library)",
     frozenset({"grpo_mega.stages", "grpo_mega.trainer", "grpo_mega.rollout_worker", "grpo_mega.sft",
                "prm.train"})),
    ("what a user runs: the CLIs, the commands, the pipelines, the memory planner; nothing below imports them",
     frozenset({"grpo_mega.cli", "grpo_mega.eval_command", "grpo_mega.quickstart", "grpo_mega.plan",
                "prm.cli", "prm.label_command", "prm.eval_command", "prm.pipeline", "prm.iterative"})),
]

# Imports that break the rules above (importer, imported), exact module names, each with its reason; an entry whose
# import is gone fails test_allowed_exceptions_are_still_needed, so the list only shrinks. Empty: keep it so.
ALLOWED: dict[tuple[str, str], str] = {}
# Modules over MAX_LINES, each with the reason it is not split yet. Empty: keep it so.
ALLOWED_LONG: dict[str, str] = {}


class Import(NamedTuple):
    importer: str
    imported: str
    line: int


def module_files(root: Path = REPO) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the packages (a package is named by its ``__init__.py``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` if it is one of our modules, else its nearest parent that is; None outside the packages."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of one of our modules by ``module`` (all statements, at any depth)."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):  # once per statement and module
            owner = _owner(target, modules)
            if owner is not None and owner != module:
                found.append(Import(module, owner, node.lineno))
    return found


def import_graph(root: Path = REPO) -> tuple[dict[str, Path], list[Import]]:
    modules = module_files(root)
    return modules, [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def layer_of(module: str) -> int | None:
    """Index in ``LAYERS`` of the longest prefix naming ``module`` or a parent package (a package root names only
    itself); None when no layer holds it."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            covers = module == prefix or (prefix not in PACKAGES and module.startswith(prefix + "."))
            if covers and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def _layer_name(index: int | None) -> str:
    return "no layer" if index is None else f"layer {index} ({LAYERS[index][0]})"


def upward_imports(imports: list[Import]) -> list[str]:
    """One message per import from a layer above the importer's, allowed exceptions left out."""
    problems = []
    for imp in imports:
        low, high = layer_of(imp.importer), layer_of(imp.imported)
        if low is None or high is None or high <= low or (imp.importer, imp.imported) in ALLOWED:
            continue
        problems.append(f"{imp.importer} (line {imp.line}), in {_layer_name(low)}, imports {imp.imported}, in "
                        f"{_layer_name(high)}: move the code to the layer it belongs to or invert the dependency")
    return problems


class Circle(NamedTuple):
    path: list[str]
    """The shortest circle through the group's first module: ``[a, b, ..., a]``."""
    also_in_group: list[str]
    """The group's other modules (each on some circle with the path's)."""


def import_circles(imports: list[Import]) -> list[Circle]:
    """One circle per strongly connected group of modules (Tarjan), allowed exceptions left out of the graph."""
    graph: dict[str, list[str]] = {}
    for imp in imports:
        if (imp.importer, imp.imported) not in ALLOWED:
            graph.setdefault(imp.importer, [])
            if imp.imported not in graph[imp.importer]:
                graph[imp.importer].append(imp.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    circles = []
    for group in groups:
        circle = _circle_through(min(group), group, graph)
        circles.append(Circle(circle, sorted(group - set(circle))))
    return circles


def _circle_through(start: str, group: set[str], graph: dict[str, list[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``group`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in graph.get(node, []):
                if target not in group:
                    continue
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def describe_circle(circle: Circle) -> str:
    text = " -> ".join(f"{name} [layer {layer_of(name)}]" for name in circle.path)
    return text + (f" (same group: {', '.join(circle.also_in_group)})" if circle.also_in_group else "")


# ----------------------------------------------------------------------------- the tests
def test_every_module_is_in_a_layer():
    modules = module_files()
    missing = sorted(name for name in modules if layer_of(name) is None)
    assert not missing, f"modules in no layer (add their prefix to LAYERS in {Path(__file__).name}): {missing}"


def test_no_module_imports_from_a_layer_above_it():
    _, imports = import_graph()
    problems = upward_imports(imports)
    assert not problems, "imports from a higher layer:\n" + "\n".join(problems)


def test_no_import_circles():
    _, imports = import_graph()
    circles = import_circles(imports)
    assert not circles, "import circles:\n" + "\n".join(describe_circle(c) for c in circles)


def test_allowed_exceptions_are_still_needed():
    _, imports = import_graph()
    present = {(imp.importer, imp.imported) for imp in imports}
    stale = sorted(set(ALLOWED) - present)
    assert not stale, f"these imports are gone: remove them from ALLOWED: {stale}"


def line_counts(root: Path = REPO) -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in module_files(root).items()}


def test_no_module_is_over_the_line_limit():
    counts = line_counts()
    long = {name: count for name, count in counts.items() if count > MAX_LINES and name not in ALLOWED_LONG}
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): {long}"
    short_again = sorted(name for name in ALLOWED_LONG if counts.get(name, 0) <= MAX_LINES)
    assert not short_again, f"these modules are no longer over {MAX_LINES} lines: remove them from ALLOWED_LONG: " \
        f"{short_again}"


def test_the_walker_sees_lazy_relative_and_package_imports(tmp_path):
    (tmp_path / "grpo_mega" / "sub").mkdir(parents=True)
    (tmp_path / "prm").mkdir()
    files = {
        "grpo_mega/__init__.py": "",
        "grpo_mega/low.py": "def f():\n    from prm import high\n",
        "grpo_mega/sub/__init__.py": "from .inner import g\nfrom .. import low\n",
        "grpo_mega/sub/inner.py": "import grpo_mega.sub\nfrom ..low import f\n",
        "prm/__init__.py": "",
        "prm/high.py": "import os\nfrom grpo_mega.sub import g, inner\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    _, imports = import_graph(tmp_path)
    assert {(i.importer, i.imported) for i in imports} == {
        ("grpo_mega.low", "prm.high"), ("grpo_mega.sub", "grpo_mega.sub.inner"), ("grpo_mega.sub", "grpo_mega.low"),
        ("grpo_mega.sub.inner", "grpo_mega.sub"), ("grpo_mega.sub.inner", "grpo_mega.low"),
        ("prm.high", "grpo_mega.sub"), ("prm.high", "grpo_mega.sub.inner")}
    circles = import_circles(imports)
    assert [c.path for c in circles] == [["grpo_mega.low", "prm.high", "grpo_mega.sub", "grpo_mega.low"]]
    assert circles[0].also_in_group == ["grpo_mega.sub.inner"]


TOP_LEVEL = {"cli", "trainer", "sft", "rollout_worker", "eval_command"}
"""The modules at the top of ``grpo_mega/``: the programs a user runs (the command, GRPO, SFT, the rollout world,
eval). Everything else lives in a package named for its one concern."""
MAX_TOP_LEVEL = 10


def test_the_top_level_holds_the_programs_and_packages_the_rest():
    top = sorted(path.stem for path in (REPO / "grpo_mega").glob("*.py") if path.stem != "__init__")
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules at the top of grpo_mega/ (at most {MAX_TOP_LEVEL}): {top}"
    assert set(top) == TOP_LEVEL, (f"the top of grpo_mega/ is {top}, expected the programs {sorted(TOP_LEVEL)}: put "
                                   "a new module in the package of its concern, or add a new program to TOP_LEVEL")


def test_every_package_says_what_it_holds_and_what_it_may_import():
    silent = []
    for init in sorted((REPO / "grpo_mega").glob("*/__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "may import" not in docstring or len(docstring.split()) < 20:
            silent.append(str(init.relative_to(REPO)))
    assert not silent, f"package docstrings that do not say what the package holds and what it may import: {silent}"
