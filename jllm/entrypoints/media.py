"""Images named by OpenAI content parts (`{"type": "image_url", "image_url": {"url": ...}}`),
loaded as vLLM's media connector does, under the operator's rules:

- `data:image/...;base64,...`: decoded in place;
- `file://...`: only under `allowed_local_media_path` (refused when it is unset);
- `http(s)://...`: only from `allowed_media_domains` (none by default: refused at once, never
  a hang on a network that is not there), within `FETCH_TIMEOUT_S` for the whole download
  (a host that sends slowly cannot hold a server worker longer) and `MAX_IMAGE_BYTES` (an
  announced Content-Length past it is refused before the body is read). A redirect is
  followed only to http(s) on an allowed domain: each hop is checked as the first URL was.

The images of a conversation are counted before any is fetched, against the model's
`limit_mm_per_prompt` (`max_images`), so one request fetches at most `max_images` images of
at most `MAX_IMAGE_BYTES` each. The server fetches on its processor pool
(`AsyncLLM.run_processor`), where a slow host holds one worker. Every refusal is a
ValueError naming the rule (a 400 in the server). The bytes go to Pillow, which reads image
formats only: nothing received is executed or unpickled; an image whose header claims more
than `MAX_IMAGE_PIXELS` pixels (a decompression bomb) is refused before its pixels are
decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.parse
import urllib.request

FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT: one image's whole download
MAX_IMAGE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 178_956_970  # vLLM's VLLM_MAX_IMAGE_PIXELS: Pillow's bomb error threshold
MAX_REDIRECTS = 5
IMAGE_PART_TYPES = ("image_url", "image_pil")


def decode_image(data: bytes):
    """A PIL image from encoded bytes (PNG, JPEG, ...), fully read; ValueError if not."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ValueError(
                f"The image is {width}x{height} ({width * height} pixels), more than the "
                f"{MAX_IMAGE_PIXELS} pixels allowed."
            )
        image.load()
    except Image.DecompressionBombError as e:  # not an OSError: it would be a 500
        raise ValueError(f"The image is too large to decode: {e}") from e
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ValueError(f"The image could not be decoded: {e}") from e
    return image


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only where `check` (the connector's rule for a first URL) lets a
    request go; a refusal propagates as the ValueError that `check` raised."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, check) -> None:
        self.check = check

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.check(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class MediaConnector:
    def __init__(
        self,
        allowed_local_media_path: str = "",
        allowed_media_domains=None,
        max_images: int | None = None,
    ) -> None:
        """`max_images`: the most images one conversation may carry (the model's
        `limit_mm_per_prompt`; 0 for a text-only model); None: not checked here."""
        self.local_root = (
            os.path.realpath(allowed_local_media_path) if allowed_local_media_path else None
        )
        self.domains = {d.lower() for d in (allowed_media_domains or [])}
        self.max_images = max_images
        self._opener = urllib.request.build_opener(_CheckedRedirects(self.check_http_url))

    def check_image_count(self, count: int) -> None:
        if self.max_images is None or count <= self.max_images:
            return
        if self.max_images == 0:
            raise ValueError(
                f"The messages carry {count} image(s), but this model takes text only."
            )
        raise ValueError(
            f"At most {self.max_images} image(s) may be provided in one prompt; got {count} "
            "(limit_mm_per_prompt)."
        )

    def fetch_image(self, url: str):
        if not isinstance(url, str) or not url:
            raise ValueError("An image_url needs a 'url' string.")
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme == "data":
            return decode_image(self._data_url(parsed.path))
        if parsed.scheme == "file":
            return decode_image(self._local(urllib.parse.unquote(parsed.path)))
        if parsed.scheme in ("http", "https"):
            return decode_image(self._fetch(url, parsed))
        raise ValueError(
            f"Image URL scheme {parsed.scheme!r} is not supported (data:, file:, http(s):)."
        )

    @staticmethod
    def _data_url(path: str) -> bytes:
        media, _, payload = path.partition(",")
        if not media.startswith("image/") or not media.endswith(";base64"):
            raise ValueError("A data URL image must be 'data:image/<format>;base64,<data>'.")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"The data URL's base64 is malformed: {e}") from e

    def _local(self, path: str) -> bytes:
        if self.local_root is None:
            raise ValueError(
                "Loading local files (file:// image URLs) is disabled: start the engine with "
                "allowed_local_media_path (--allowed-local-media-path) set to their folder."
            )
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.local_root]) != self.local_root:
            raise ValueError(
                f"The file {path!r} is outside allowed_local_media_path ({self.local_root})."
            )
        try:
            with open(real, "rb") as f:
                return f.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise ValueError(f"The image file could not be read: {e}") from e

    def check_http_url(self, url: str) -> None:
        """ValueError unless `url` is http(s) on one of the allowed domains."""
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https"):
            raise ValueError(
                f"The image URL was redirected to {url!r}; only http(s) URLs are followed."
            )
        host = (parsed.hostname or "").lower()
        if host not in self.domains:
            raise ValueError(
                f"The domain {host!r} of the image URL is not allowed; the server fetches "
                "images only from --allowed-media-domains"
                + (f" ({', '.join(sorted(self.domains))})." if self.domains else " (none set).")
            )

    def _fetch(self, url: str, parsed) -> bytes:
        self.check_http_url(url)
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        too_large = ValueError(f"The image at {url} is larger than {MAX_IMAGE_BYTES} bytes.")
        chunks, size = [], 0
        try:
            with self._opener.open(url, timeout=FETCH_TIMEOUT_S) as response:
                length = response.headers.get("Content-Length", "")
                if length.isdigit() and int(length) > MAX_IMAGE_BYTES:
                    raise too_large
                # read1: whatever arrived, so the deadline is checked as the bytes come.
                while size <= MAX_IMAGE_BYTES:
                    chunk = response.read1(MAX_IMAGE_BYTES + 1 - size)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                    if time.monotonic() > deadline:
                        raise ValueError(
                            f"The image at {url} took more than {FETCH_TIMEOUT_S} s to fetch."
                        )
        except OSError as e:
            raise ValueError(f"The image at {url} could not be fetched: {e}") from e
        if size > MAX_IMAGE_BYTES:
            raise too_large
        return b"".join(chunks)


def chat_messages_with_images(messages: list, media: MediaConnector) -> tuple[list, list]:
    """OpenAI chat messages -> (the messages as chat templates take them, the images in
    order). A message whose content has image_url parts keeps a list of parts with each
    image as `{"type": "image"}` (the placeholder the model's template writes); text-only
    content is left as it is. The images are counted (`media.check_image_count`) before
    the first is fetched."""
    media.check_image_count(sum(len(_image_parts(m)) for m in messages))
    out, images = [], []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not _image_parts(m):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(media.fetch_image(url))
                parts.append({"type": "image"})
            elif kind == "image_pil":  # vLLM's offline form: a PIL image as it is
                images.append(part.get("image_pil"))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"Message content of type {kind!r} is not supported.")
        out.append({**m, "content": parts})
    return out, images


def _image_parts(message) -> list:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES]
