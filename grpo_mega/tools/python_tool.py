"""The ``python`` tool's semantics, run inside the call's sandboxed process: the code runs as a script / notebook
cell (ToRL, SimpleTIR): what it prints, then the value of its last line when that line is an expression (as the
REPL shows it); on an exception, the output so far and the exception's last line, not the whole traceback (the
policy needs the error, not our frames).
"""

from __future__ import annotations

import ast
import builtins
import sys
import traceback

PYTHON_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Runs Python code and returns what it prints; the value of a last line that is an "
                       "expression is printed too. Each call starts afresh (no variables are kept).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run"}},
            "required": ["code"],
        },
    },
}


def error_line(error: BaseException) -> str:
    """The exception as the last line(s) of its traceback: ``ZeroDivisionError: division by zero``; a syntax error
    with its line and caret."""
    return "".join(traceback.format_exception_only(type(error), error)).rstrip()


def run_code(code: str) -> tuple[str | None, str]:
    """Runs ``code`` in a fresh ``__main__`` namespace, printing to sys.stdout. Returns (error kind or None,
    message): the message is the exception's last line when the code raised."""
    try:
        tree = ast.parse(code, filename="<tool>", mode="exec")
    except SyntaxError as error:
        return "exception", error_line(error)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(tree, "<tool>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as error:  # exit() ends the cell; a non-zero code is the program's error
        if error.code not in (None, 0):
            return "exception", f"SystemExit: {error.code}"
    except MemoryError:
        return "memory", "MemoryError: out of memory (the sandbox's memory limit)"
    except BaseException as error:
        return kind_of(error), error_line(error)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return None, ""


def kind_of(error: BaseException) -> str:
    """The error kind of an exception a call raised: limits the sandbox set have kinds of their own."""
    import errno
    if isinstance(error, MemoryError):
        return "memory"
    if isinstance(error, OSError) and error.errno == errno.EFBIG:
        return "file_size"
    if isinstance(error, (BlockingIOError, RuntimeError)) and (
            getattr(error, "errno", None) == errno.EAGAIN or "can't start new thread" in str(error)):
        return "processes"
    return "exception"
