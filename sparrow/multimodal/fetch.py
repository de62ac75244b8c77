"""Media bytes from a request's source: a `data:` URL (base64), an http(s) URL, or a local file
(`file://` or an absolute path) under the allowed directory.

http(s) fetching is safe to run in a gateway that can reach private networks (SSRF): each
URL's host is resolved once and refused when any of its addresses is not globally routable
(loopback, private, link-local, multicast, reserved, unspecified, and IPv4 inside IPv4-mapped or
6to4 IPv6 addresses). The request then goes to the checked address, carrying the original
`Host` header and, over TLS, the original name for SNI and certificate checks, so a second DNS
answer cannot move it (DNS rebinding). Redirects are followed here, each hop checked the same
way, under one deadline and one byte limit. `MediaLimits.allow_private_urls` lifts the address
check for trusted deployments.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from PIL import Image

from sparrow.multimodal.media import MediaError, MediaLimits, decode_image

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
LIMITS = MediaLimits()


def load_image(
    source: str, limits: MediaLimits = LIMITS, client: httpx.Client | None = None
) -> Image.Image:
    """Load an image from a data URL, an http(s) URL or an allowed local file, as RGB.

    `client` replaces the default httpx client (tests pass one with a MockTransport).
    """
    return decode_image(fetch_bytes(source, limits, client), limits)


def fetch_bytes(
    source: str, limits: MediaLimits = LIMITS, client: httpx.Client | None = None
) -> bytes:
    """The raw bytes behind `source`, at most `limits.max_bytes` of them.

    An http(s) source goes through the address checks even with a `client` given; the client
    only replaces the transport (a MockTransport in tests).
    """
    if source.startswith("data:"):
        return _data_url_bytes(source, limits)
    if source.startswith(("http://", "https://")):
        return _http_bytes(source, limits, client)
    if source.startswith("file://"):
        return _file_bytes(source[len("file://") :], limits)
    if os.path.isabs(source):
        return _file_bytes(source, limits)
    raise MediaError("image source must be a data URL, an http(s) URL or an allowed file path")


def resolve(host: str, port: int) -> list[Address]:
    """The distinct addresses `host` resolves to for a TCP connection, in the resolver's order
    (an IP literal, decimal and hex IPv4 forms included, resolves to itself without DNS).
    Tests replace this function to map names without DNS."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


def is_public(address: Address) -> bool:
    """Whether `address` is globally routable: not loopback, private, link-local, multicast,
    reserved or unspecified. An IPv4-mapped or 6to4 IPv6 address is judged by its IPv4."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            return is_public(embedded)
    # `is_global` alone passes IPv4 multicast (224.0.0.0/4) and IPv4-compatible ::a.b.c.d.
    return address.is_global and not (
        address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or address.is_loopback
        or address.is_link_local
        or address.is_private
    )


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


def _http_bytes(source: str, limits: MediaLimits, client: httpx.Client | None) -> bytes:
    deadline = time.monotonic() + limits.timeout_s
    url = _parse(source)
    own = client is None
    if own:
        # An explicit transport leaves out environment proxies: a proxy would resolve the name
        # itself, and httpcore's proxy tunnel ignores `sni_hostname`. No keep-alive: a pooled
        # connection is keyed by address and keeps the TLS state negotiated for the name it
        # was opened for, which a redirect to another name on the same address must not reuse.
        transport = httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))
        client = httpx.Client(transport=transport)
    try:
        for _ in range(limits.max_redirects + 1):
            with _get(client, url, limits, deadline) as response:
                if not response.has_redirect_location:
                    return _read_body(response, url, limits, deadline)
                url = _redirect_target(url, response.headers["location"])
        raise MediaError(f"fetching {source} took more than {limits.max_redirects} redirects")
    except httpx.TimeoutException:
        raise _timed_out(url, limits) from None
    except httpx.HTTPError as e:
        raise MediaError(f"fetching {url} failed: {type(e).__name__}") from None
    finally:
        if own:
            client.close()


def _parse(url: str) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise MediaError(f"invalid media URL: {e}") from None
    if parsed.scheme not in ("http", "https"):
        raise MediaError(f"media URL scheme must be http or https, not {parsed.scheme!r}")
    if not parsed.raw_host:
        raise MediaError(f"media URL {url} has no host")
    return parsed


def _redirect_target(url: httpx.URL, location: str) -> httpx.URL:
    try:
        target = url.join(location)
    except httpx.InvalidURL as e:
        raise MediaError(f"{url} redirected to an invalid URL: {e}") from None
    return _parse(str(target))


def _checked_addresses(url: httpx.URL, allow_private: bool) -> list[Address]:
    host = url.raw_host.decode("ascii")
    try:
        addresses = resolve(host, url.port or (443 if url.scheme == "https" else 80))
    except (OSError, ValueError) as e:
        raise MediaError(f"cannot resolve media URL host {host!r}: {e}") from None
    if not addresses:
        raise MediaError(f"media URL host {host!r} resolves to no address")
    if not allow_private:
        # Every address, not just the one connected to: a name must not mix public and
        # private answers.
        for address in addresses:
            if not is_public(address):
                raise MediaError(
                    f"media URL host {host!r} resolves to a private or reserved "
                    f"address ({address}); refused"
                )
    return addresses


@contextlib.contextmanager
def _get(
    client: httpx.Client, url: httpx.URL, limits: MediaLimits, deadline: float
) -> Iterator[httpx.Response]:
    """A streamed GET of `url` sent to its checked addresses, in the resolver's order until one
    connects, with `url`'s Host header and TLS server name."""
    addresses = _checked_addresses(url, limits.allow_private_urls)
    headers = {"Host": url.netloc.decode("ascii")}
    extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
    for i, address in enumerate(addresses):
        # Resolution has no timeout of its own; its time counts against the deadline.
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(url, limits)
        request = client.build_request(
            "GET",
            url.copy_with(host=str(address)),
            headers=headers,
            timeout=remaining,
            extensions=extensions,
        )
        try:
            response = client.send(request, stream=True, follow_redirects=False)
            break
        except httpx.ConnectError:
            if i == len(addresses) - 1:
                raise
        except httpx.InvalidURL as e:  # httpx parses a redirect's Location even when not following
            raise MediaError(f"{url} redirected to an invalid URL: {e}") from None
    try:
        yield response
    finally:
        response.close()


def _read_body(
    response: httpx.Response, url: httpx.URL, limits: MediaLimits, deadline: float
) -> bytes:
    if response.status_code != 200:
        raise MediaError(f"fetching {url} returned HTTP {response.status_code}")
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise MediaError(f"{url} is {declared} bytes, over {limits.max_bytes}")
    chunks, total = [], 0
    # Each read waits at most the time left when the hop started; a server that trickles bytes
    # is stopped at its first chunk past the deadline.
    for chunk in response.iter_bytes():
        total += len(chunk)
        if total > limits.max_bytes:
            raise MediaError(f"{url} exceeds {limits.max_bytes} bytes")
        if time.monotonic() > deadline:
            raise _timed_out(url, limits)
        chunks.append(chunk)
    return b"".join(chunks)


def _timed_out(url: httpx.URL, limits: MediaLimits) -> MediaError:
    return MediaError(f"fetching {url} timed out after {limits.timeout_s:g} s")


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
