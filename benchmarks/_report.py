"""Helpers shared by the benchmark scripts: the machine line, peak memory and the docs page.

Each script runs as ``python benchmarks/<script>.py`` (its folder is then on ``sys.path``) and
writes its own ``## ...`` section of ``docs/benchmarks.md``; these are the pieces they share.
"""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import re
import resource
import sys
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(*packages: str) -> dict[str, str]:
    """Hardware and library versions of this run (torch, numba, numpy, then ``packages``).

    Args:
        packages: import names of further libraries to report (e.g. ``"torchmetrics"``);
            ``pytorch_metric_learning`` is shown as ``pytorch-metric-learning``.
    """
    torch = importlib.import_module("torch")
    info = {
        "cpu": cpu_name(),
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
    }
    for name in ("torch", "numba", "numpy", *packages):
        info[name.replace("_", "-")] = importlib.import_module(name).__version__
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return info


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB."""
    # Linux reports kilobytes, macOS bytes.
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def write_section(path: Path, section: str, title: str) -> None:
    """Replace (or append) the section headed ``title`` of the benchmarks page, keeping the others."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if not text.lstrip().startswith("# Benchmarks"):
        text = "# Benchmarks\n\n" + text
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    block = section.rstrip() + "\n\n"
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip() + "\n")
