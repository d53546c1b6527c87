"""What every benchmark records beside its numbers: the command as run and the machine."""
from __future__ import annotations

import platform
import shlex
import sys
from pathlib import Path


def command_line() -> str:
    """The command that produced a result, as a user would retype it."""
    first = Path(sys.argv[0])
    head = ["-m", first.parent.name] if first.name == "__main__.py" else [sys.argv[0]]
    return shlex.join(["python", *head, *sys.argv[1:]])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
