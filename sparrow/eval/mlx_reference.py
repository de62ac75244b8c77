"""mlx-lm as the consistency reference: the MLX checkpoint both engines read, and mlx-lm's
next-token logits on it.

mlx and mlx-lm are imported on first use. The `test` extra installs them (on Linux with
mlx-cpu, the CPU backend; with mlx-cuda-13 instead mlx runs on an NVIDIA GPU). mlx runs on
its default device, whatever that is; Sparrow's device is chosen separately.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

WRITERS = ("sparrow", "mlx-lm")

MISSING = (
    "--reference mlx-lm needs mlx and mlx-lm: pip install -e '.[test]', or "
    "pip install mlx==0.32.4 mlx-cpu==0.32.4 mlx-lm==0.32.2 (on a Mac without mlx-cpu; "
    "on an NVIDIA GPU mlx-cuda-13 in place of mlx-cpu)"
)

CPU_BF16_NOTE = (
    "bfloat16 on mlx's CPU backend is not a meaningful reference: its bf16 arithmetic is "
    "far from its own float32 (91.9% top-1 on the built-in model); compare in float32 on a "
    "CPU and in bfloat16 on a GPU"
)


def _mlx() -> Any:
    """`mlx.core`, or SystemExit saying how to install mlx and mlx-lm."""
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: mlx without a backend library
        raise SystemExit(f"{MISSING} ({e})") from e
    return mx


def environment(dtype: str) -> dict[str, str]:
    """mlx's default device (where mlx-lm runs), the versions of mlx and mlx-lm, and a note
    where `dtype` ("float32" / "bfloat16") on that device is not a meaningful reference."""
    mx = _mlx()
    import mlx_lm

    device = mx.default_device()
    fields = {
        "mlx_device": str(device),
        "mlx_dtype": dtype,
        "mlx_version": mx.__version__,
        "mlx_lm_version": mlx_lm.__version__,
    }
    if device.type == mx.cpu and dtype == "bfloat16":
        fields["note"] = CPU_BF16_NOTE
    return fields


def is_mlx_quantized(model_dir: Path) -> bool:
    """Whether config.json has MLX's `quantization` block (what mlx-lm quantises by)."""
    return "quantization" in json.loads((model_dir / "config.json").read_text())


def write_mlx_checkpoint(
    src: Path, out: Path, writer: str, quantize: str, device: str, dtype: torch.dtype
) -> Path:
    """`src` quantised (`quantize`: "4bit" / "8bit", group 64, MLX's policy) into `out` in
    `dtype` (the scales' and biases' dtype too), by Sparrow's writer (as `sparrow checkpoint
    quantize` does on `device`) or by `mlx_lm.convert`."""
    if writer == "sparrow":
        from sparrow.config import QuantConfig
        from sparrow.loader.mlx_writer import save_mlx_checkpoint
        from sparrow.loader.weights import load_checkpoint

        q = QuantConfig.from_name(quantize)
        model = load_checkpoint(src, device, dtype, quantize=q, progress=False)
        return save_mlx_checkpoint(model, out, tokenizer_dir=src)
    _mlx()
    from mlx_lm.convert import convert

    bits = int(quantize.removesuffix("bit"))
    name = str(dtype).removeprefix("torch.")
    try:
        convert(str(src), str(out), quantize=True, q_group_size=64, q_bits=bits, dtype=name)
    except (ValueError, KeyError) as e:  # a model type or tensor names mlx-lm does not know
        raise SystemExit(f"mlx_lm.convert cannot read {src}: {e!r}") from e
    return out


@contextmanager
def mlx_checkpoint(
    model_dir: Path, writer: str, quantize: str, device: str, dtype: torch.dtype
) -> Iterator[tuple[Path, str]]:
    """(the MLX checkpoint both engines read, who quantised it): `model_dir` as it is when
    it is MLX-quantised, else `model_dir` quantised by `writer` into a temporary directory
    that lives as long as the context."""
    if is_mlx_quantized(model_dir):
        yield model_dir, "as given"
        return
    with tempfile.TemporaryDirectory(prefix="sparrow-consistency-") as tmp:
        out = write_mlx_checkpoint(model_dir, Path(tmp) / "mlx", writer, quantize, device, dtype)
        yield out, writer


def mlx_lm_logits(model_dir: Path, ids: list[int], context: int, dtype: str) -> torch.Tensor:
    """fp32 logits [len(ids) - context, V] predicting ids[context:]: mlx-lm loads `model_dir`,
    casts its float parameters to `dtype` ("float32" / "bfloat16"; in bf16 what mlx-lm's
    `cast_predicate` keeps, such as `A_log`, stays as stored) and runs one forward over
    ids[:-1] through its prefill path, on mlx's default device."""
    mx = _mlx()
    from mlx.utils import tree_map_with_path
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(Path(model_dir))
    except (ValueError, KeyError) as e:
        raise SystemExit(f"mlx-lm cannot load {model_dir}: {e!r}") from e
    target = getattr(mx, dtype)

    def every(_: str) -> bool:
        return True

    # float32 widens every float exactly, A_log included
    keep = every if dtype == "float32" else getattr(model, "cast_predicate", every)

    def cast(path: str, v: Any) -> Any:
        return v.astype(target) if keep(path) and mx.issubdtype(v.dtype, mx.floating) else v

    model.update(tree_map_with_path(cast, model.parameters()))
    tokens = mx.array(ids[:-1])[None]
    logits = model(tokens, cache=make_prompt_cache(model))[0, context - 1 :].astype(mx.float32)
    out = torch.from_numpy(np.array(logits))
    del model, logits
    mx.clear_cache()
    return out
