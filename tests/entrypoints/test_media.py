"""Image URLs under the operator's rules, against a real HTTP server on 127.0.0.1: a redirect
is followed only to an allowed domain over http(s), the images are counted before any is
fetched, and an image that would decode to too many pixels is a ValueError (a 400), not a
crash."""

from __future__ import annotations

import io
import struct
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from openai_server import MODEL_NAME, RunningServer, server_args
from oracle import SMALL
from PIL import Image

from jllm import LLM
from jllm.entrypoints import media
from jllm.entrypoints.media import MediaConnector, chat_messages_with_images


def png(width: int, height: int) -> bytes:
    """A 1-bit grey PNG whose header claims width x height (its data is a few bytes only)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def small_png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


class ImageHost:
    """Serves /cat.png, /bomb.png and redirects; records every path asked for."""

    def __init__(self) -> None:
        host = self
        self.paths: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host.paths.append(self.path)
                port = self.server.server_address[1]
                redirects = {
                    "/to-same": "/cat.png",
                    "/to-other-host": f"http://localhost:{port}/cat.png",
                    "/to-file": "file:///etc/hostname",
                    "/loop": "/loop",
                }
                if self.path in redirects:
                    self.send_response(302)
                    self.send_header("Location", redirects[self.path])
                    self.end_headers()
                    return
                body = {"/cat.png": small_png(), "/bomb.png": png(30_000, 30_000)}.get(self.path)
                self.send_response(200 if body else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def host():
    h = ImageHost()
    yield h
    h.close()


def test_a_redirect_on_an_allowed_domain_is_followed(host):
    image = MediaConnector("", ["127.0.0.1"]).fetch_image(host.url("/to-same"))
    assert image.size == (4, 3)
    assert host.paths == ["/to-same", "/cat.png"]


@pytest.mark.parametrize(
    "path, error",
    [("/to-other-host", "'localhost'.*not allowed"), ("/to-file", "file:.*not allowed")],
)
def test_a_redirect_elsewhere_is_refused(host, path, error):
    with pytest.raises(ValueError, match=error):
        MediaConnector("", ["127.0.0.1"]).fetch_image(host.url(path))
    assert host.paths == [path]  # the redirect's target was never asked for


def test_a_redirect_loop_ends(host):
    with pytest.raises(ValueError, match="could not be fetched"):
        MediaConnector("", ["127.0.0.1"]).fetch_image(host.url("/loop"))
    assert len(host.paths) <= media.MAX_REDIRECTS + 1


def test_a_decompression_bomb_is_a_value_error(host, monkeypatch):
    connector = MediaConnector("", ["127.0.0.1"])
    with pytest.raises(ValueError, match="too large"):
        connector.fetch_image(host.url("/bomb.png"))
    # Without Pillow's own limit (a library may lift it), jllm's still holds.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    with pytest.raises(ValueError, match="pixels allowed"):
        media.decode_image(png(20_000, 10_000))


def image_message(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]}]


@pytest.mark.parametrize("max_images, error", [(1, "At most 1 image"), (0, "text only")])
def test_images_are_counted_before_any_is_fetched(host, max_images, error):
    connector = MediaConnector("", ["127.0.0.1"], max_images=max_images)
    messages = image_message(host.url("/cat.png"), host.url("/cat.png"))
    with pytest.raises(ValueError, match=error):
        chat_messages_with_images(messages, connector)
    assert host.paths == []
    _, images = chat_messages_with_images(messages[:1], MediaConnector("", ["127.0.0.1"], 2))
    assert len(images) == 2


def test_nothing_is_fetched_for_a_text_only_model(llama_dir, host):
    """Neither the server nor LLM.chat fetches an image a text-only model would refuse."""
    from jllm.entrypoints.openai.api_server import build_app, build_engine

    args = server_args(llama_dir, "--allowed-media-domains", "127.0.0.1")
    engine, metrics = build_engine(args)
    running = RunningServer(build_app(args, engine, metrics), engine)
    try:
        body = {"model": MODEL_NAME, "messages": image_message(host.url("/cat.png"))}
        for path in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(f"{running.url}{path}", json=body, timeout=60)
            assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
        assert host.paths == []
    finally:
        running.stop()
        engine.shutdown()
    llm = LLM(llama_dir, allowed_media_domains=["127.0.0.1"], **SMALL)
    with pytest.raises(ValueError, match="text only"):
        llm.chat(image_message(host.url("/cat.png")))
    assert host.paths == []


class SlowHost:
    """/big announces more bytes than allowed and sends its body only when released;
    /drip sends a byte at a time, slowly."""

    def __init__(self) -> None:
        host = self
        self.release = threading.Event()
        self.sent = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                size = media.MAX_IMAGE_BYTES + 1 if self.path == "/big" else 1000
                self.send_header("Content-Length", str(size))
                self.end_headers()
                try:
                    if self.path == "/big":
                        host.release.wait(60)
                        self.wfile.write(b"x" * 100)
                        return
                    for _ in range(size):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        host.sent += 1
                        if host.release.wait(0.02):
                            return
                except OSError:  # the client left
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"


@pytest.fixture
def slow_host():
    h = SlowHost()
    yield h
    h.release.set()
    h.server.shutdown()
    h.server.server_close()


def test_an_announced_size_past_the_cap_is_refused_before_the_body(slow_host):
    """The body is never sent (until released): only the announced size can refuse it."""
    connector = MediaConnector("", ["127.0.0.1"])
    with pytest.raises(ValueError, match="larger than"):
        connector.fetch_image(slow_host.url("/big"))


def test_a_slow_download_ends_at_the_fetch_timeout(slow_host, monkeypatch):
    """Each byte comes well within the socket's timeout; the whole download does not: a host
    that drips cannot hold a processor-pool worker past the fetch timeout."""
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.3)
    connector = MediaConnector("", ["127.0.0.1"])
    with pytest.raises(ValueError, match="took more than 0.3 s"):
        connector.fetch_image(slow_host.url("/drip"))
    assert 0 < slow_host.sent < 1000
