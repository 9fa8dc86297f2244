"""The ``calculator`` tool: arithmetic on integers and decimals, exact, read with ``ast`` (never ``eval``).

It runs inline in the caller, not in the sandbox pool: no code of the policy's is executed (the expression is
walked node by node and only numbers, + - * / // % ** and parentheses are accepted) and every operand and result is
kept under ``MAX_DIGITS`` digits, so a call's time and memory are bounded by construction; a round trip through a
worker would only add its milliseconds.

Integers stay exact at any size up to the bound; decimals and ``/`` are exact fractions; a result is printed as an
integer, as an exact decimal when it has one (``7/4`` -> ``1.75``), else to 17 significant digits (``1/3``).
"""

from __future__ import annotations

import ast
import math
from decimal import Decimal
from fractions import Fraction

MAX_DIGITS = 4000
"""Largest operand or result, in decimal digits (a bound on the time and memory of one expression)."""
MAX_EXPRESSION_CHARS = 2000

_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression exactly: integers and decimals, + - * / // % ** and "
                       "parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "The expression, for example (1234 * 5678) - 91 / 7"}},
            "required": ["expression"],
        },
    },
}


class CalculatorError(ValueError):
    """An expression the calculator does not accept (not arithmetic, or too large)."""


def _digits(value: Fraction) -> int:
    """Decimal digits of the larger of the numerator and the denominator (cheap: from the bit lengths)."""
    bits = max(abs(value.numerator).bit_length(), value.denominator.bit_length())
    return int(bits * 0.30103) + 1


def _bounded(value: Fraction) -> Fraction:
    if _digits(value) > MAX_DIGITS:
        raise CalculatorError(f"a number of more than {MAX_DIGITS} digits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer powers are exact: use ** with an integer exponent")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError("0 cannot be raised to a negative power")
    n = abs(exponent.numerator)
    # estimate the result's size before computing it: 10 ** 10 ** 10 must fail at once, not after minutes
    if base not in (0, 1, -1) and n * math.log10(max(abs(base.numerator), base.denominator)) > MAX_DIGITS:
        raise CalculatorError(f"a number of more than {MAX_DIGITS} digits")
    return _bounded(base ** exponent.numerator)


def _evaluate(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, source)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError("only finite numbers")
        # a decimal from its text, not from the float ast made of it: 12345678901234567890.5 stays exact
        literal = ast.get_source_segment(source, node).replace("_", "")
        return _bounded(Fraction(literal) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ZeroDivisionError("division by zero")
        result = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right, ast.Mult: lambda: left * right,
                  ast.Div: lambda: left / right, ast.FloorDiv: lambda: Fraction(left // right),
                  ast.Mod: lambda: left % right}[type(node.op)]()
        return _bounded(result)
    shown = ast.unparse(node) if not isinstance(node, ast.Expression) else "?"
    raise CalculatorError(f"not arithmetic: {shown!r} (only numbers, + - * / // % ** and parentheses)")


def format_number(value: Fraction) -> str:
    """An integer as is, a fraction with a finite decimal expansion exactly, any other to 17 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator == 1:
        text = format(Decimal(value.numerator) / Decimal(value.denominator), "f") if _digits(value) < 28 else None
        if text is None:  # beyond Decimal's default precision: scale by a power of ten, exactly
            scale = 0
            while (value * 10 ** scale).denominator != 1:
                scale += 1
            digits = str(abs((value * 10 ** scale).numerator)).rjust(scale + 1, "0")
            text = ("-" if value < 0 else "") + digits[:-scale] + "." + digits[-scale:]
        return text
    return repr(float(value)) if _digits(value) < 300 else format(Decimal(value.numerator) / value.denominator, ".17g")


def calculate(expression: str) -> str:
    """The value of ``expression`` as text. Raises CalculatorError (not arithmetic, too large, not a string) or
    ZeroDivisionError."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"an expression of more than {MAX_EXPRESSION_CHARS} characters")
    cleaned = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(cleaned, mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"cannot read {expression!r}: {error.msg}") from None
    try:
        return format_number(_evaluate(tree, cleaned))
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
