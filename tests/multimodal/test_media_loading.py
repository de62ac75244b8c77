"""Media loading: data URLs, http(s) through a mocked httpx transport (no network), local
files only under the allowed directory, and the byte limits; every failure a MediaError."""

import base64
import io
import ipaddress

import httpx
import numpy as np
import pytest
from PIL import Image

from sparrow.multimodal import MediaError, MediaLimits, fetch, load_image


def _png(width=37, height=21, seed=0):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _data_url(data):
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_data_url_round_trip():
    data = _png()
    image = load_image(_data_url(data))
    assert image.mode == "RGB" and image.size == (37, 21)
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(data))))


def test_data_url_errors():
    with pytest.raises(MediaError, match="base64"):
        load_image("data:image/png," + "abc")
    with pytest.raises(MediaError, match="valid base64"):
        load_image("data:image/png;base64,@@@@")
    with pytest.raises(MediaError, match="exceeds"):
        load_image(_data_url(_png()), MediaLimits(max_bytes=100))
    with pytest.raises(MediaError, match="must be"):
        load_image("ftp://example.com/a.png")
    with pytest.raises(MediaError, match="must be"):
        load_image("relative/path.png")


def test_local_files_only_under_allowed_dir(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_png())
    (tmp_path / "secret.png").write_bytes(_png())
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    limits = MediaLimits(allowed_dir=allowed)
    assert load_image(str(allowed / "a.png"), limits).size == (37, 21)
    assert load_image(f"file://{allowed / 'a.png'}", limits).size == (37, 21)
    for escape in (
        str(tmp_path / "secret.png"),
        str(allowed / ".." / "secret.png"),
        str(allowed / "link.png"),
    ):
        with pytest.raises(MediaError, match="outside"):
            load_image(escape, limits)
    with pytest.raises(MediaError, match="not allowed"):
        load_image(str(allowed / "a.png"))
    with pytest.raises(MediaError, match="does not exist"):
        load_image(str(allowed / "missing.png"), limits)
    with pytest.raises(MediaError, match="exceeds"):
        load_image(str(allowed / "a.png"), MediaLimits(allowed_dir=allowed, max_bytes=64))


@pytest.fixture
def public_dns(monkeypatch):
    """img.test resolves to a public address (TEST-NET addresses are not public)."""
    real = fetch.resolve
    monkeypatch.setattr(
        fetch,
        "resolve",
        lambda host, port: (
            [ipaddress.ip_address("93.184.215.14")] if host == "img.test" else real(host, port)
        ),
    )


def _client(handler):
    return httpx.Client(transport=httpx.MockTransport(handler), follow_redirects=True)


def test_http_fetch_and_redirect(public_dns):
    data = _png(seed=5)

    def handler(request):
        if request.url.path == "/old":
            return httpx.Response(302, headers={"location": "https://img.test/a.png"})
        return httpx.Response(200, content=data, headers={"content-type": "image/png"})

    with _client(handler) as client:
        assert load_image("https://img.test/a.png", client=client).size == (37, 21)
        assert load_image("http://img.test/old", client=client).size == (37, 21)


def test_http_errors(public_dns):
    data = _png()

    def handler(request):
        path = request.url.path
        if path == "/missing":
            return httpx.Response(404)
        if path == "/declared-big":
            return httpx.Response(200, content=data, headers={"content-length": str(10**9)})
        if path == "/stream-big":
            return httpx.Response(200, content=iter([data[:50], data[50:], data]))
        if path == "/slow":
            raise httpx.ReadTimeout("slow", request=request)
        if path == "/down":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, content=b"<html>not an image</html>")

    limits = MediaLimits(max_bytes=len(data) + 10)
    cases = {
        "/missing": "HTTP 404",
        "/declared-big": "bytes, over",
        "/stream-big": "exceeds",
        "/slow": "timed out",
        "/down": "ConnectError",
        "/html": "cannot decode",
    }
    with _client(handler) as client:
        for path, message in cases.items():
            with pytest.raises(MediaError, match=message):
                load_image(f"https://img.test{path}", limits, client=client)


def test_package_imports_nothing_from_the_engine():
    import ast
    from pathlib import Path

    import sparrow.multimodal

    for path in Path(sparrow.multimodal.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith("sparrow.") or name.startswith("sparrow.multimodal"), (
                    f"{path.name} imports {name}"
                )
