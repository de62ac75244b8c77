"""Fetch and decode images from request content parts.

Sources: `data:` URLs (base64), `http(s)://` URLs through httpx with byte and time limits,
and local files (`file://` or absolute paths) only under an allowed directory. Decoding
matches HF `load_image`: EXIF orientation applied, then `convert("RGB")` (alpha is dropped,
not composited; CMYK, grayscale and palette images convert the PIL way). Every failure is a
`MediaError`, which the servers turn into an HTTP 400.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
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
    timeout_s: float = 10.0
    max_redirects: int = 3
    allowed_dir: Path | None = None  # local files are refused when None


def media_digest(data: bytes, preprocessing: object) -> str:
    """A digest of a media item as the model sees it: its encoded bytes and the settings that
    turn them into patches (a spec's repr). Equal digests mean equal patches, so the prefix
    cache keys placeholder tokens by it."""
    h = hashlib.blake2b(data, digest_size=16)
    h.update(repr(preprocessing).encode())
    return h.hexdigest()


def load_image(source: str, limits: MediaLimits = MediaLimits(),
               client: httpx.Client | None = None) -> Image.Image:
    """Load an image from a data URL, an http(s) URL or an allowed local file, as RGB.

    `client` replaces the default httpx client (tests pass one with a MockTransport).
    """
    return decode_image(fetch_bytes(source, limits, client), limits)


def fetch_bytes(source: str, limits: MediaLimits = MediaLimits(),
                client: httpx.Client | None = None) -> bytes:
    """The raw bytes behind `source`, at most `limits.max_bytes` of them."""
    if source.startswith("data:"):
        return _data_url_bytes(source, limits)
    if source.startswith(("http://", "https://")):
        return _http_bytes(source, limits, client)
    if source.startswith("file://"):
        return _file_bytes(source[len("file://"):], limits)
    if os.path.isabs(source):
        return _file_bytes(source, limits)
    raise MediaError("image source must be a data URL, an http(s) URL or an allowed file path")


def _data_url_bytes(url: str, limits: MediaLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError("data URL must be base64: data:<mime>;base64,<data>")
    if len(payload) > (limits.max_bytes * 4) // 3 + 4:
        raise MediaError(f"data URL exceeds {limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"data URL is not valid base64: {e}") from None
    if len(data) > limits.max_bytes:
        raise MediaError(f"data URL exceeds {limits.max_bytes} bytes")
    return data


def _http_bytes(url: str, limits: MediaLimits, client: httpx.Client | None) -> bytes:
    own = client is None
    if own:
        client = httpx.Client(timeout=limits.timeout_s, follow_redirects=True,
                              max_redirects=limits.max_redirects)
    try:
        with client.stream("GET", url, timeout=limits.timeout_s) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching {url} returned HTTP {response.status_code}")
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
                raise MediaError(f"{url} is {declared} bytes, over {limits.max_bytes}")
            chunks, total = [], 0
            for chunk in response.iter_bytes():
                total += len(chunk)
                if total > limits.max_bytes:
                    raise MediaError(f"{url} exceeds {limits.max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.TimeoutException:
        raise MediaError(f"fetching {url} timed out after {limits.timeout_s:g} s") from None
    except httpx.HTTPError as e:
        raise MediaError(f"fetching {url} failed: {type(e).__name__}") from None
    finally:
        if own:
            client.close()


def _file_bytes(path: str, limits: MediaLimits) -> bytes:
    if limits.allowed_dir is None:
        raise MediaError("local image files are not allowed")
    root = Path(limits.allowed_dir).resolve()
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root):
        raise MediaError("image path is outside the allowed directory")
    if not resolved.is_file():
        raise MediaError("image file does not exist")
    if resolved.stat().st_size > limits.max_bytes:
        raise MediaError(f"image file exceeds {limits.max_bytes} bytes")
    return resolved.read_bytes()


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
