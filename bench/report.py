"""What the ``make bench`` benchmarks share: the machine, the load, running a bench script in a fresh interpreter,
a text table, the JSON record.

A record is ``{"machine", "date", "wall_seconds", "load_average", "command", **fields}`` written to its path, which
is printed last (``write_record``), so a caller can take the last line of the output as the record's path.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def machine() -> dict:
    """What the figures were measured on."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE")
            * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def load_average() -> float:
    """The 1-minute load average, rounded."""
    return round(os.getloadavg()[0], 2)


def run_script(script: str, *args: str) -> None:
    """Run ``bench/<script> args`` in a fresh interpreter from the repository root (bench/ and the root on its
    path); RuntimeError with the tail of its output when it fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH), str(ROOT)]))
    done = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed ({done.returncode}):\n{done.stdout[-4000:]}")


def text_table(columns: Sequence[tuple[str, str, str]], rows: Sequence[dict]) -> str:
    """Right-aligned table: ``columns`` are (header, row key, format spec such as ``".2f"``); a row without the
    key (or with None there) shows ``-``."""
    cells = [[header for header, _, _ in columns]]
    for row in rows:
        cells.append(["-" if row.get(key) is None else format(row[key], spec) for _, key, spec in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(" ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells)


def build_record(fields: dict, *, started: float, load_before: float) -> dict:
    """The JSON record: machine, start date (UTC), wall seconds since ``started`` (a ``time.time()``), the load
    average before and after, the command line, then ``fields``."""
    return {
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_seconds": round(time.time() - started, 1), "load_average": [load_before, load_average()],
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), **fields,
    }


def write_record(record: dict, out: Path) -> Path:
    """Write ``record`` as JSON to ``out`` (folders made) and print its path, last."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(out)
    return out
