"""SSRF guards on http(s) media URLs: every address a host resolves to must be public, the
request goes to the checked address with the original Host header and TLS name, redirects are
re-checked hop by hop under one deadline. Names resolve through a stub (no DNS); the only
sockets are on loopback."""

import contextlib
import http.server
import ipaddress
import shutil
import ssl
import subprocess
import threading
import time

import httpx
import pytest

from sparrow.multimodal import MediaError, MediaLimits, fetch, fetch_bytes

PUBLIC = "93.184.215.14"
PUBLIC_V6 = "2606:2800:21f:cb07:6820:80da:af6b:8b2c"
BODY = bytes(range(256)) * 3 + b"\x00end"  # 772 bytes, not a multiple of any chunk size


@pytest.fixture
def dns(monkeypatch):
    """A dict of name -> addresses that `fetch.resolve` answers from; IP literals and names not
    in it go to the real resolver (literals never reach DNS)."""
    table, real = {}, fetch.resolve

    def resolve(host, port):
        if host in table:
            return [ipaddress.ip_address(a) for a in table[host]]
        return real(host, port)

    monkeypatch.setattr(fetch, "resolve", resolve)
    return table


class Recorder:
    """A MockTransport client that records each request and answers through `handler`."""

    def __init__(self, handler=None):
        self.requests = []
        self.handler = handler or (lambda request: httpx.Response(200, content=BODY))
        self.client = httpx.Client(transport=httpx.MockTransport(self._handle))

    def _handle(self, request):
        self.requests.append(request)
        return self.handler(request)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x.png",
        "http://10.1.2.3/x.png",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/x.png",
        "http://[::ffff:127.0.0.1]/x.png",
        "http://[::ffff:a9fe:a9fe]:8080/latest",  # 169.254.169.254, IPv4-mapped in hex
        "http://[2002:7f00:1::]/x.png",  # 6to4 around 127.0.0.1
        "http://[fd12:3456::1]/x.png",
        "http://[fe80::1]/x.png",
        "http://[::]/x.png",
        "https://2130706433/x.png",  # 127.0.0.1 in decimal
        "http://0x7f.0.0.1:8000/x.png",
        "http://017700000001/x.png",  # octal
        "http://127.1/x.png",
        "http://0.0.0.0/x.png",
        "http://100.64.7.9/x.png",  # carrier-grade NAT
        "http://224.0.0.251/x.png",  # multicast: `is_global` alone lets it through
        "http://240.1.2.3/x.png",
        "http://192.168.77.3:31337/a/b?c=d#e",
    ],
)
def test_non_public_literals_are_refused_before_any_request(url):
    recorder = Recorder()
    with pytest.raises(MediaError, match=r"private or reserved address \(.+\); refused"):
        fetch_bytes(url, client=recorder.client)
    assert recorder.requests == []


def test_names_resolving_to_private_addresses_are_refused(dns):
    dns["intranet.example"] = ["10.0.0.5"]
    dns["metadata.example"] = ["169.254.169.254"]
    dns["mixed.example"] = [PUBLIC, "192.168.1.7"]  # one private answer is enough
    dns["mapped.example"] = [PUBLIC_V6, "::ffff:10.9.8.7"]
    recorder = Recorder()
    with pytest.raises(MediaError, match=r"'intranet.example' resolves to a private .*10\.0\.0\.5"):
        fetch_bytes("https://intranet.example/x.png", client=recorder.client)
    for host in ("metadata.example", "mixed.example", "mapped.example"):
        with pytest.raises(MediaError, match="refused"):
            fetch_bytes(f"http://{host}:8080/x.png", client=recorder.client)
    assert recorder.requests == []


def test_public_host_is_fetched_at_the_checked_address(dns):
    dns["img.example"] = [PUBLIC]
    dns["v6.example"] = [PUBLIC_V6]
    recorder = Recorder()
    assert fetch_bytes("https://img.example:8443/a%20b.png?w=7", client=recorder.client) == BODY
    assert fetch_bytes("http://v6.example/x.png", client=recorder.client) == BODY
    https, v6 = recorder.requests
    assert https.url == httpx.URL(f"https://{PUBLIC}:8443/a%20b.png?w=7")
    assert https.headers["host"] == "img.example:8443"
    assert https.extensions["sni_hostname"] == "img.example"
    assert v6.url.host == PUBLIC_V6 and v6.url.port is None
    assert v6.headers["host"] == "v6.example"
    assert "sni_hostname" not in v6.extensions


def test_unresolvable_host(dns, monkeypatch):
    def fail(host, port, **kwargs):
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr(fetch.socket, "getaddrinfo", fail)
    with pytest.raises(MediaError, match="cannot resolve media URL host 'nowhere.example'"):
        fetch_bytes("http://nowhere.example/x.png", client=Recorder().client)
    dns["empty.example"] = []
    with pytest.raises(MediaError, match="resolves to no address"):
        fetch_bytes("http://empty.example/x.png", client=Recorder().client)


def test_the_next_checked_address_is_tried_when_one_does_not_connect(dns):
    dns["img.example"] = [PUBLIC_V6, PUBLIC]

    def handler(request):
        if request.url.host == PUBLIC_V6:
            raise httpx.ConnectError("network unreachable", request=request)
        return httpx.Response(200, content=BODY)

    recorder = Recorder(handler)
    assert fetch_bytes("http://img.example/x.png", client=recorder.client) == BODY
    assert [r.url.host for r in recorder.requests] == [PUBLIC_V6, PUBLIC]


def _redirecting(locations):
    """A handler answering path /<i> with a 302 to locations[i], and any other path with BODY."""

    def handler(request):
        step = request.url.path.lstrip("/")
        if step.isdigit() and int(step) < len(locations):
            return httpx.Response(302, headers={"location": locations[int(step)]})
        return httpx.Response(200, content=BODY)

    return handler


@pytest.mark.parametrize(
    "location",
    [
        "http://10.0.0.5/x.png",
        "http://[::1]:8080/x.png",
        "http://internal.example/x.png",
        "//169.254.169.254/latest/meta-data",  # scheme-relative
    ],
)
def test_a_redirect_to_a_private_address_is_refused(dns, location):
    dns["cdn.example"] = [PUBLIC]
    dns["internal.example"] = ["172.16.3.4"]
    recorder = Recorder(_redirecting([location]))
    with pytest.raises(MediaError, match="refused"):
        fetch_bytes("https://cdn.example/0", client=recorder.client)
    assert len(recorder.requests) == 1


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("file:///etc/passwd", "scheme must be http or https, not 'file'"),
        ("ftp://cdn.example/x.png", "scheme must be http or https"),
        ("gopher://cdn.example:70/_x", "scheme must be http or https"),
        ("data:image/png;base64,AAAA", "redirected to an invalid URL"),
        ("http://[::1/x.png", "RemoteProtocolError"),  # httpx rejects this Location itself
    ],
)
def test_a_redirect_to_another_scheme_or_a_bad_url_is_refused(dns, location, message):
    dns["cdn.example"] = [PUBLIC]
    recorder = Recorder(_redirecting([location]))
    with pytest.raises(MediaError, match=message):
        fetch_bytes("http://cdn.example/0", client=recorder.client)
    assert len(recorder.requests) == 1


def test_redirects_are_followed_and_checked_hop_by_hop(dns):
    dns["a.example"] = [PUBLIC]
    dns["b.example"] = ["198.51.100.77", PUBLIC]  # TEST-NET-2 is reserved
    dns["c.example"] = ["8.8.4.4"]
    # Relative, then absolute to another host and port, then path-relative on that host.
    recorder = Recorder(_redirecting(["/1", "https://c.example:444/2", "3"]))
    assert (
        fetch_bytes("http://a.example/0", MediaLimits(max_redirects=3), client=recorder.client)
        == BODY
    )
    hops = [(r.url.host, r.url.port, r.headers["host"], r.url.path) for r in recorder.requests]
    c = ("8.8.4.4", 444, "c.example:444")
    assert hops == [
        (PUBLIC, None, "a.example", "/0"),
        (PUBLIC, None, "a.example", "/1"),
        (*c, "/2"),
        (*c, "/3"),
    ]
    recorder = Recorder(_redirecting(["http://b.example/x.png"]))
    with pytest.raises(MediaError, match=r"'b.example' .* \(198\.51\.100\.77\)"):
        fetch_bytes("http://a.example/0", client=recorder.client)


def test_too_many_redirects(dns):
    dns["loop.example"] = [PUBLIC]
    recorder = Recorder(lambda request: httpx.Response(301, headers={"location": "/again"}))
    with pytest.raises(MediaError, match="more than 2 redirects"):
        fetch_bytes(
            "http://loop.example/start", MediaLimits(max_redirects=2), client=recorder.client
        )
    assert len(recorder.requests) == 3
    recorder = Recorder(lambda request: httpx.Response(302, headers={"location": "/again"}))
    with pytest.raises(MediaError, match="more than 0 redirects"):
        fetch_bytes(
            "http://loop.example/start", MediaLimits(max_redirects=0), client=recorder.client
        )
    assert len(recorder.requests) == 1


def test_one_deadline_covers_every_hop_and_the_body(dns):
    dns["slow.example"] = [PUBLIC]

    def slow_redirects(request):
        time.sleep(0.12)
        return httpx.Response(307, headers={"location": f"/{len(recorder.requests)}"})

    recorder = Recorder(slow_redirects)
    started = time.monotonic()
    with pytest.raises(MediaError, match="timed out after 0.3 s"):
        fetch_bytes(
            "http://slow.example/0",
            MediaLimits(timeout_s=0.3, max_redirects=9),
            client=recorder.client,
        )
    assert len(recorder.requests) < 5 and time.monotonic() - started < 1.0

    def trickle():
        for i in range(50):
            time.sleep(0.02)
            yield bytes([i]) * 3

    recorder = Recorder(lambda request: httpx.Response(200, content=trickle()))
    with pytest.raises(MediaError, match="timed out"):
        fetch_bytes("http://slow.example/x", MediaLimits(timeout_s=0.25), client=recorder.client)


def test_the_byte_limit_still_holds(dns):
    dns["big.example"] = [PUBLIC]
    recorder = Recorder(lambda request: httpx.Response(200, content=iter([BODY] * 3)))
    limits = MediaLimits(max_bytes=2 * len(BODY) + 1)
    with pytest.raises(MediaError, match=f"exceeds {limits.max_bytes} bytes"):
        fetch_bytes("http://big.example/x", limits, client=recorder.client)


class _Handler(http.server.BaseHTTPRequestHandler):
    hosts: list = []

    def do_GET(self):
        type(self).hosts.append(self.headers["host"])
        self.send_response(200)
        self.send_header("content-length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _serve(context=None):
    """An http.server on 127.0.0.1 in a thread (TLS under `context`); yields (port, the Host
    headers it has seen)."""
    handler = type("Handler", (_Handler,), {"hosts": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], handler.hosts
    finally:
        server.shutdown()
        server.server_close()


def test_allow_private_urls_reaches_a_loopback_server():
    with _serve() as (port, hosts):
        url = f"http://127.0.0.1:{port}/x.png"
        with pytest.raises(MediaError, match=r"\(127\.0\.0\.1\); refused"):
            fetch_bytes(url)
        assert hosts == []
        assert fetch_bytes(url, MediaLimits(allow_private_urls=True)) == BODY
        assert hosts == [f"127.0.0.1:{port}"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not found")
def test_tls_uses_the_original_name_for_sni_and_the_certificate(dns, tmp_path):
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=img.example",
            "-addext",
            "subjectAltName=DNS:img.example",
            "-keyout",
            str(tmp_path / "key.pem"),
            "-out",
            str(tmp_path / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    names = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    dns["img.example"] = ["127.0.0.1"]
    dns["other.example"] = ["127.0.0.1"]
    limits = MediaLimits(allow_private_urls=True, timeout_s=5)
    verify = ssl.create_default_context(cafile=tmp_path / "cert.pem")
    with _serve(context) as (port, hosts), httpx.Client(verify=verify) as client:
        assert fetch_bytes(f"https://img.example:{port}/x.png", limits, client) == BODY
        with pytest.raises(MediaError, match="ConnectError"):  # the certificate names img.example
            fetch_bytes(f"https://other.example:{port}/x.png", limits, client)
    assert names == ["img.example", "other.example"]
    assert hosts == [f"img.example:{port}"]
