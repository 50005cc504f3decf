"""Where and when a benchmark ran: the machine lines the scripts in ``benchmarks/`` print.

A number taken on a shared machine means little without the CPU, the cores this process may use,
the date and the load around the run; each script prints these above its table.
"""

from __future__ import annotations

import datetime
import os
import platform

import torch


def load_average() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def machine() -> dict:
    """CPU model, usable cores, UTC date, load average now, torch version and thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores_usable": len(os.sched_getaffinity(0)),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": load_average(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def header(before: dict, load_after: list[float] | None, how: str) -> str:
    """One line: the machine of :func:`machine`, the load after the run (None: a script that
    prints as it goes says it at the end), and how it was timed."""
    after = "" if load_after is None else f" / {load_after[0]} after"
    return (
        f"{before['cpu']}, {before['cores_usable']} cores usable, {before['date']}, load average "
        f"{before['load_average'][0]} before{after}; torch {before['torch']} on "
        f"{before['torch_threads']} thread(s); {how}"
    )
