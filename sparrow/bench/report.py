"""Where benchmark and eval results go: JSON files under bench-out/ by default."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """The report, with the SPARROW_* settings it ran under (SPARROW_KERNELS changes what
    is measured)."""
    report = report | {"env": {k: v for k, v in os.environ.items() if k.startswith("SPARROW_")}}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
