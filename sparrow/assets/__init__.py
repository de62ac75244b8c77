"""Files that ship with the package.

`default_model/`: the built-in default checkpoint, what runs when no `--model` is given. A
3.3M-parameter model of Qwen3.5/3.6's architecture (Gated DeltaNet, gated attention, MoE with
a shared expert) trained by `python -m sparrow.train --device cuda --minutes 2.5 --batch 32`
on the Python standard library's own source (PSF license), with a 4,096-token byte-level BPE
and the ChatML template; `training.json` beside it records the run (steps, seed, held-out
perplexity).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).parent / "default_model"


def default_checkpoint() -> Path:
    """The built-in default checkpoint directory."""
    return DEFAULT_MODEL
