"""Logging: the library logs through `logging.getLogger(__name__)` (names under `sparrow.`);
the command line sets the level and one format for Sparrow's and uvicorn's records."""

from __future__ import annotations

import logging
import sys
from typing import Any

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup(level: str = "info") -> None:
    """Records of `level` and above from every logger go to stderr in one format."""
    logging.basicConfig(
        level=level.upper(), format=FORMAT, datefmt="%H:%M:%S", stream=sys.stderr, force=True
    )


def uvicorn_settings(level: str) -> dict[str, Any]:
    """uvicorn.Config keywords that leave its records to the root logger's format (no config
    of its own) at `level`; one access line per request only at debug."""
    return {"log_config": None, "log_level": level, "access_log": level == "debug"}
