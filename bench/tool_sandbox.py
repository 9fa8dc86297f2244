"""Seconds per tool call: the sandbox's pool of pre-started workers against a fresh interpreter per call (issue 75:
"the pool, not spawn per call").

Two calls, 100 times each: the ``calculator`` (an exact product; inline in the ToolSet, no process at all, against
``python -c`` importing our calculator) and a small Python snippet (the ``python`` tool in the pool: a forked
process per call in its own PID / mount namespaces with its rlimits and user id, against a bare ``python -c`` of
the same snippet, which has none of that isolation). Sequential calls (the latency one rollout waits), then the
100 snippet calls in one ``ToolSet.run`` (throughput over the pool's workers). The fresh interpreters run from
this machine's venv with its site-packages, as a spawn-per-call sandbox would.

    python bench/tool_sandbox.py          # ~1 min on 2 cores; writes bench/results/tool_sandbox.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from report import load_average, machine  # noqa: E402

from grpo_mega.tools import SandboxConfig, ToolCall, build_toolset  # noqa: E402

EXPRESSION = "123456789 * 987654321 + 4321"
SNIPPET = "import math\nvalues = [math.comb(30, k) for k in range(31)]\nsum(values)"


def _figures(seconds: list[float]) -> dict:
    return {"calls": len(seconds), "mean_s": round(statistics.mean(seconds), 6),
            "median_s": round(statistics.median(seconds), 6), "max_s": round(max(seconds), 6)}


def _timed(function, calls: int) -> list[float]:
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return seconds


def _fresh(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2, help="the pool's workers (default: this machine's 2 cores)")
    parser.add_argument("--out", default=str(BENCH / "results" / "tool_sandbox.json"))
    args = parser.parse_args()

    started = time.perf_counter()
    tools = build_toolset(["python", "calculator"], SandboxConfig(workers=args.workers))
    pool_start_s = time.perf_counter() - started
    with tools:
        calculator = ToolCall("calculator", {"expression": EXPRESSION})
        snippet = ToolCall("python", {"code": SNIPPET})
        expected = tools.run([calculator, snippet])
        assert [r.error for r in expected] == [None, None], expected
        fresh_calculator = (f"from grpo_mega.tools.calculator import calculate; print(calculate({EXPRESSION!r}))")
        fresh_snippet = f"exec(compile({SNIPPET!r}, '<tool>', 'exec'))"
        assert _fresh(fresh_calculator).strip() == expected[0].content
        rows = {
            "calculator_toolset_inline": _figures(_timed(lambda: tools.run([calculator]), args.calls)),
            "calculator_fresh_python_c": _figures(_timed(lambda: _fresh(fresh_calculator), args.calls)),
            "snippet_pool_sequential": _figures(_timed(lambda: tools.run([snippet]), args.calls)),
            "snippet_fresh_python_c": _figures(_timed(lambda: _fresh(fresh_snippet), args.calls)),
        }
        started = time.perf_counter()
        batch = tools.run([snippet] * args.calls)
        elapsed = time.perf_counter() - started
        assert all(r.content == expected[1].content for r in batch)
        rows["snippet_pool_one_run_of_all_calls"] = {"calls": args.calls, "seconds": round(elapsed, 4),
                                                     "per_call_s": round(elapsed / args.calls, 6),
                                                     "workers": args.workers}
        isolation = tools.isolation
    for name in ("calculator", "snippet"):
        fresh = rows[f"{name}_fresh_python_c"]["median_s"]
        ours = rows["calculator_toolset_inline" if name == "calculator" else "snippet_pool_sequential"]["median_s"]
        rows[f"{name}_speedup_median"] = round(fresh / ours, 1)
    result = {"machine": machine(), "load_average": load_average(), "command": "python bench/tool_sandbox.py",
              "expression": EXPRESSION, "snippet": SNIPPET, "pool_start_s": round(pool_start_s, 3),
              "isolation": {k: v for k, v in isolation.items() if k != "ready"}, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
