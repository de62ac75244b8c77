"""Where benchmark and eval results go: JSON files under bench-out/ by default, each with the
commit and the command that produced it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any


def _commit() -> str:
    """SPARROW_COMMIT when set (a copy of the tree whose .git is absent or stale, as on the
    GPU machine), else the checkout's commit, "+dirty" when the tree has uncommitted
    changes; "unknown" outside a git checkout."""
    if os.environ.get("SPARROW_COMMIT"):
        return os.environ["SPARROW_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            text=True,
            capture_output=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            text=True,
            capture_output=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """The report, with its commit, command and the SPARROW_* settings it ran under
    (SPARROW_KERNELS changes what is measured)."""
    command = (
        "python -m " + sys.modules["__main__"].__spec__.name
        if getattr(sys.modules["__main__"], "__spec__", None)
        else sys.argv[0]
    )
    report = (
        {
            "commit": _commit(),
            "command": " ".join([command, *map(shlex.quote, sys.argv[1:])]),
        }
        | report
        | {"env": {k: v for k, v in os.environ.items() if k.startswith("SPARROW_")}}
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
