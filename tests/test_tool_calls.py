"""What the tools answer: the calculator's exact results, the python tool's output / last expression / traceback
form and output cap, determinism (random included), user tools (schema from the docstring, row arguments, a
reward, one that raises or hangs), and tool specs checked before launch in one line."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from grpo_mega.tools import SandboxConfig, ToolCall, build_toolset, check_tool_specs
from grpo_mega.tools.calculator import calculate

USER_TOOLS = '''
import time


def lookup(key: str, upper: bool = False) -> str:
    """Looks a word up in the table.

    Args:
        key: The word to look up.
        upper: Whether to answer in capitals.
    """
    value = {"pi": "3.14159", "e": "2.71828"}.get(key, "unknown")
    return value.upper() if upper else value


def check_answer(answer: int, *, ground_truth: int = -1) -> tuple:
    """Checks an answer.

    Args:
        answer: The policy's answer.
    """
    return ("correct" if answer == ground_truth else "wrong"), float(answer == ground_truth)


def as_dict(x: float) -> dict:
    """Halves a number.

    Args:
        x: The number.
    """
    return {"content": str(x / 2), "reward": 0.5}


def raises(x: int) -> str:
    """Fails.

    Args:
        x: Anything.
    """
    raise KeyError(f"no entry {x}")


def hangs(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"
'''


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user_tools") / "my_tools.py"
    path.write_text(USER_TOOLS)
    return path


@pytest.fixture(scope="module")
def toolset(tool_file):
    specs = ["python", "calculator"] + [f"{tool_file}:{name}" for name in
                                        ("lookup", "check_answer", "as_dict", "raises", "hangs")]
    with build_toolset(specs, SandboxConfig(timeout_s=2, workers=2, max_output_bytes=200, seed=7)) as tools:
        yield tools


def _python(toolset, code: str):
    return toolset.run([ToolCall("python", {"code": code})])[0]


@pytest.mark.parametrize("expression,expected", [
    ("123456789 * 987654321", "121932631112635269"),
    ("(12345 + 678) * 91 - 4 // 3", "1185092"),
    ("2 ** 100", "1267650600228229401496703205376"),
    ("7 / 4", "1.75"),
    ("1 / 3", "0.3333333333333333"),
    ("0.1 + 0.2", "0.3"),
    ("12345678901234567890.5 / 2", "6172839450617283945.25"),
    ("-7 % 3", "2"),
    ("2 ** -3", "0.125"),
    ("10 / 3 * 3", "10"),
    ("3 ^ 4", "81"),
])
def test_calculator_is_exact(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression,kind", [
    ("__import__('os').system('ls')", "bad_arguments"), ("abs(-1)", "bad_arguments"), ("x + 1", "bad_arguments"),
    ("10 ** 10 ** 10", "bad_arguments"), ("2 ** 0.5", "bad_arguments"), ("1 +", "bad_arguments"),
    ("1 / 0", "exception"), ("5 % 0", "exception"),
])
def test_calculator_refuses_what_is_not_arithmetic(toolset, expression, kind):
    started = time.monotonic()
    result = toolset.run([ToolCall("calculator", {"expression": expression})])[0]
    assert result.error == kind and result.content
    assert time.monotonic() - started < 0.5  # 10 ** 10 ** 10 is refused before it is computed


def test_python_prints_the_output_and_the_last_expression(toolset):
    assert _python(toolset, "x = 6\nprint('x is', x)\nx * 7").content == "x is 6\n42\n"
    assert _python(toolset, "y = 1").content == ""
    assert _python(toolset, "None").content == ""
    assert _python(toolset, "print('a')\nimport sys; print('b', file=sys.stderr)\n'c'").content == "a\nb\n'c'\n"


def test_python_shows_the_last_line_of_a_traceback(toolset):
    result = _python(toolset, "def f(n):\n    return 1 / n\nprint('before')\nf(0)")
    assert result.error == "exception"
    assert result.content == "before\nZeroDivisionError: division by zero"
    syntax = _python(toolset, "print(1")
    assert syntax.error == "exception" and syntax.content.endswith("SyntaxError: '(' was never closed")


def test_python_output_is_cut_and_the_cut_said(toolset):
    result = _python(toolset, "print('y' * 1000)")
    assert result.error is None
    assert result.content.startswith("y" * 200) and "y" * 201 not in result.content
    assert result.content.endswith("[... 801 more bytes of output cut]")


def test_outputs_are_a_function_of_the_input(toolset):
    code = ("import random, numpy\nprint(random.random(), random.randint(0, 10**9), numpy.random.rand())\n"
            "print(sorted({'apple', 'pear', 'fig'}, key=hash))")
    results = toolset.run([ToolCall("python", {"code": code})] * 4)
    assert len({r.content for r in results}) == 1 and results[0].error is None
    with build_toolset(["python"], SandboxConfig(timeout_s=2, workers=1, seed=8)) as other_seed:
        assert _python(other_seed, code).content != results[0].content


def test_user_tool_schema_comes_from_the_docstring(toolset):
    schemas = {s["function"]["name"]: s for s in toolset.schemas()}
    assert list(schemas) == ["python", "calculator", "lookup", "check_answer", "as_dict", "raises", "hangs"]
    assert schemas["lookup"] == {"type": "function", "function": {
        "name": "lookup", "description": "Looks a word up in the table.",
        "parameters": {"type": "object", "properties": {
            "key": {"type": "string", "description": "The word to look up."},
            "upper": {"type": "boolean", "description": "Whether to answer in capitals."}},
            "required": ["key"]},
        "return": {"type": "string"}}}
    # the row's keyword-only argument is not the policy's to see
    assert list(schemas["check_answer"]["function"]["parameters"]["properties"]) == ["answer"]


def test_user_tools_answer_with_rewards_and_row_arguments(toolset):
    calls = [ToolCall("lookup", {"key": "pi", "upper": True}), ToolCall("check_answer", {"answer": 42}),
             ToolCall("check_answer", {"answer": 42}), ToolCall("as_dict", {"x": 3})]
    rows = [{}, {"ground_truth": 42}, {"create_kwargs": {"ground_truth": 41}}, None]
    results = toolset.run(calls, rows)
    assert [(r.content, r.error, r.reward) for r in results] == [
        ("3.14159", None, None), ("correct", None, 1.0), ("wrong", None, 0.0), ("1.5", None, 0.5)]
    # the policy cannot pass the row's argument itself
    spoofed = toolset.run([ToolCall("check_answer", {"answer": 1, "ground_truth": 1})])[0]
    assert spoofed.error == "bad_arguments"


@pytest.mark.parametrize("call,kind,text", [
    (ToolCall("lookup", {}), "bad_arguments", "needs the argument 'key'"),
    (ToolCall("lookup", {"key": 3}), "bad_arguments", "must be string"),
    (ToolCall("lookup", {"key": "pi", "colour": "red"}), "bad_arguments", "no argument 'colour'"),
    (ToolCall("check_answer", {"answer": True}), "bad_arguments", "must be integer"),
    (ToolCall("raises", {"x": 3}), "exception", "KeyError: 'no entry 3'"),
    (ToolCall("hangs", {"seconds": 60}), "timeout", "timed out after 2 s"),
    (ToolCall("lookup_word", {"key": "pi"}), "unknown_tool", "unknown tool 'lookup_word'"),
])
def test_user_tool_errors_become_results(toolset, call, kind, text):
    started = time.monotonic()
    result = toolset.run([call])[0]
    assert result.error == kind and text in result.content, result
    assert time.monotonic() - started <= 2 + 1
    assert toolset.run([ToolCall("hangs", {"seconds": 0})])[0].content == "woke"  # the pool still serves


def test_check_tool_specs_is_one_line_before_launch(tmp_path, tool_file):
    (tmp_path / "broken.py").write_text("import a_module_that_does_not_exist\n\ndef tool(x: int) -> str:\n"
                                        "    '''T.\n\n    Args:\n        x: X.\n    '''\n")
    (tmp_path / "undocumented.py").write_text("def tool(x: int) -> str:\n    return str(x)\n\nNOT_A_FUNCTION = 3\n")
    check_tool_specs(["python", "calculator", f"{tool_file}:lookup"])
    cases = {
        "pyhton": "unknown tool 'pyhton'",
        f"{tmp_path}/missing.py:tool": "no such file",
        f"{tmp_path}/broken.py:tool": "a_module_that_does_not_exist",
        f"{tmp_path}/undocumented.py:tool": "cannot build its JSON schema",
        f"{tmp_path}/undocumented.py:NOT_A_FUNCTION": "not callable",
        f"{tool_file}:lookpu": "has no attribute 'lookpu'",
        "no_such_package_xyz.tools:fn": "cannot import module",
    }
    children_before = len(os.listdir("/proc/self/task"))
    for spec, text in cases.items():
        with pytest.raises(ValueError) as error:
            check_tool_specs(["python", spec])
        message = str(error.value)
        assert text in message and "\n" not in message and repr(spec) in message, message
    with pytest.raises(ValueError, match="a second tool named 'python'"):
        check_tool_specs(["python", "python"])
    assert len(os.listdir("/proc/self/task")) == children_before  # no pool, no thread was started


def test_the_package_does_not_import_torch():
    import subprocess
    code = "import sys, grpo_mega.tools; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.stdout.split() == ["False", "False"]


def test_arguments_that_are_not_json_do_not_cost_a_worker(toolset):
    for _ in range(3):  # more than the pool's 2 workers: a lost worker would hang the third
        assert toolset.run([ToolCall("lookup", {"key": "e", "upper": {1, 2}})])[0].error == "bad_arguments"
        # past the schema's checks (a float is a "number"), still not JSON: refused before a worker is taken
        result = toolset.run([ToolCall("check_answer", {"answer": 1})], [{"ground_truth": {1}}])[0]
        assert result.error == "bad_arguments" and "JSON" in result.content
    assert toolset.run([ToolCall("python", {"code": "1"})] * 3)[2].content == "1\n"
