"""Media errors and limits, and image decoding.

Decoding matches HF `load_image`: EXIF orientation applied, then `convert("RGB")` (alpha is
dropped, not composited; CMYK, grayscale and palette images convert the PIL way). Every
failure is a `MediaError`, which the servers turn into an HTTP 400. Fetching the bytes lives
in `sparrow.multimodal.fetch`.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps


class MediaError(ValueError):
    """A media item that cannot be used: unreachable, too large, undecodable, degenerate."""


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on what one media item may cost before and after decoding."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 64 * 1024 * 1024  # decoded width * height, checked before pixel decode
    min_side: int = 2  # a 1-pixel side carries no usable image
    max_video_frames: int = 108_000  # frames in one video's stream: an hour at 30 fps
    timeout_s: float = 10.0  # one deadline for an http(s) fetch, over all its redirects
    max_redirects: int = 3
    allowed_dir: Path | None = None  # local files are refused when None
    # http(s) URLs whose host resolves to a loopback, private, link-local or otherwise
    # non-public address are refused (SSRF); True lets them through, for a deployment whose
    # clients are trusted with its network.
    allow_private_urls: bool = False


def media_digest(data: bytes, preprocessing: object) -> str:
    """A digest of a media item as the model sees it: its encoded bytes and the settings that
    turn them into patches (a spec's repr). Equal digests mean equal patches, so the prefix
    cache keys placeholder tokens by it."""
    h = hashlib.blake2b(data, digest_size=16)
    h.update(repr(preprocessing).encode())
    return h.hexdigest()


def decode_image(data: bytes, limits: MediaLimits = MediaLimits()) -> Image.Image:
    """Decode bytes into an RGB image, EXIF orientation applied, sizes checked first."""
    if len(data) > limits.max_bytes:
        raise MediaError(f"image exceeds {limits.max_bytes} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            _check_size(image.width, image.height, limits)
            image.load()
            image = ImageOps.exif_transpose(image)
            image = image.convert("RGB")
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError("image has too many pixels") from None
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, struct.error...
        raise MediaError(f"cannot decode image: {type(e).__name__}: {e}") from None
    _check_size(image.width, image.height, limits)
    return image


def _check_size(width: int, height: int, limits: MediaLimits) -> None:
    if width < limits.min_side or height < limits.min_side:
        raise MediaError(f"image is {width}x{height}; each side must be >= {limits.min_side}")
    if width * height > limits.max_pixels:
        raise MediaError(f"image is {width}x{height}, over {limits.max_pixels} pixels")
