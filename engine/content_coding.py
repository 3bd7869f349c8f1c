"""Request bodies decoded as their ``Content-Encoding`` says, within a bound on the *decoded*
bytes (no ASGI, no MLX; :func:`engine.http_edge.read_body` calls it in the thread pool).

* ``gzip`` / ``x-gzip``: every member (RFC 1952: concatenated members are one stream).
* ``deflate``: the zlib-wrapped form (RFC 1950, what the name means in HTTP) or, failing that, raw
  deflate (RFC 1951), which some clients send under that name and browsers accept.
* ``zstd``: every frame (RFC 8878), with a window of at most 8 MiB (RFC 9659's bound for HTTP: a
  frame asking for more is refused before the decoder allocates it); Codex-style clients send it.

Past ``limit`` decoded bytes a 413: every decompressor is driven with an output limit, so a bomb
never decodes more than the bound (+1 byte; zstd: + one 128 KiB block), each body once. A body that is not what its encoding says (damaged,
cut short, or with bytes after its stream) is a 400 ``invalid_body_encoding``; an encoding not read
here is a 415 naming those that are. A stacked ``Content-Encoding`` (``gzip, zstd``) is undone
the last coding first, each step within the bound.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import zstandard

from engine.errors import ApiError

#: zlib's window bits for each form
GZIP, ZLIB, RAW_DEFLATE = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS, -zlib.MAX_WBITS
#: the largest zstd window decoded (RFC 9659 § 3: HTTP's zstd encoders stay within 8 MiB)
ZSTD_MAX_WINDOW = 8 * 1024**2
#: the most bytes one compressed byte of zstd decodes to: an RLE block (RFC 8878 § 3.1.1.2.2), a
#: 3-byte header and its byte, repeats it up to the 128 KiB a block holds
ZSTD_MAX_RATIO = 32 * 1024
#: the longest zstd frame header (RFC 8878 § 3.1.1.1: 4 + 14 bytes)
_ZSTD_HEADER = 18
#: compressed bytes handed to a decoder at first, and at most (:func:`_feed`)
_FIRST_SLICE, _MAX_SLICE = 256, 1 << 20
#: gzip members / zstd frames read from one body: a client sends one (a few where it compresses
#: piece by piece); each costs a decoder, and 16 MiB of empty members took 1.3 s (gzip) to 2.3 s
#: (zstd) of a worker thread per request
MAX_STREAMS = 256


class Invalid(Exception):
    """The body is not what its encoding says; the message says why."""


def body_too_large(limit: int) -> ApiError:
    """The 413 for a body past ``limit`` bytes, as sent or decoded."""
    return ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")


def _feed(view: memoryview, pos: int, cap: Callable[[], int] | None = None) -> Iterator[tuple[memoryview, int]]:
    """``view`` from ``pos`` in slices that double from :data:`_FIRST_SLICE` bytes up to
    :data:`_MAX_SLICE`, each with the position after it. A decoder handed all that is left keeps
    a copy of whatever follows its stream (``unused_data``): a body of many small members or
    frames cost the square of its size (a 2 MiB body of empty gzip members took 2.5 s, 16 MiB
    minutes). In slices, a stream's leftover is at most the last slice, about twice the stream.
    ``cap``: asked before each slice, the most bytes it may have (at least 1 is given)."""
    step = _FIRST_SLICE
    while pos < len(view):
        piece = view[pos : pos + (step if cap is None else max(1, min(step, cap())))]
        pos += len(piece)
        yield piece, pos
        step = min(2 * step, _MAX_SLICE)


def _inflate(view: memoryview, pos: int, wbits: int, room: int, limit: int) -> tuple[list[bytes], int]:
    """The zlib stream of ``view`` from ``pos``, at most ``room`` bytes of it (the 413 past
    ``limit`` else), and the position after it. Raises zlib.error, or Invalid for a stream cut
    short."""
    inflate = zlib.decompressobj(wbits)
    out: list[bytes] = []
    size = 0
    for piece, end in _feed(view, pos):
        got = inflate.decompress(piece, room - size + 1)
        size += len(got)
        if size > room:
            raise body_too_large(limit)
        out.append(got)
        if inflate.eof:
            return out, end - len(inflate.unused_data)
    raise Invalid("it ends early")


def _gzip(body: bytes, limit: int) -> list[bytes]:
    view = memoryview(body)
    parts: list[bytes] = []
    pos = size = 0
    members = 1
    while True:  # a member after a member: RFC 1952 § 2.2, "a series of members"
        try:
            out, pos = _inflate(view, pos, GZIP, limit - size, limit)
        except zlib.error as e:
            if parts:  # the bytes after a whole member are not one
                raise Invalid(f"the {len(body) - pos} bytes after its end are no gzip member") from None
            raise Invalid(str(e)) from None
        parts += out
        size += sum(map(len, out))
        if pos == len(body):
            return parts
        members += 1
        _count(members, "gzip members")


def _count(streams: int, what: str) -> None:
    """Invalid once a body has more than :data:`MAX_STREAMS` ``what``."""
    if streams > MAX_STREAMS:
        raise Invalid(f"more than {MAX_STREAMS} {what}")


def _deflate(body: bytes, limit: int) -> list[bytes]:
    view = memoryview(body)
    try:
        out, end = _inflate(view, 0, ZLIB, limit, limit)
    except zlib.error:  # not the zlib form: raw deflate, as browsers take it
        try:
            out, end = _inflate(view, 0, RAW_DEFLATE, limit, limit)
        except zlib.error as e:
            raise Invalid(f"neither zlib nor raw deflate ({e})") from None
    if end < len(body):
        raise Invalid(f"{len(body) - end} bytes follow its end")
    return out


def _zstd_frame(
    dctx: zstandard.ZstdDecompressor, view: memoryview, pos: int, room: int, limit: int
) -> tuple[list[bytes], int]:
    """The zstd frame of ``view`` from ``pos``, at most ``room`` bytes of it (the 413 past
    ``limit`` else), and the position after it, decoded once (it was measured by zstandard's
    stream reader, then decoded again: that reader bounds its output but passes a cut frame as
    an end). The frame decoder has no output limit: a frame that declares its size is refused
    past the room before it is decoded (the decoder refuses to write more than it declared);
    one that does not (a streamed frame) is handed no more than decodes within the room left,
    so it goes past it by one block at most."""
    declared = zstandard.get_frame_parameters(view[pos : pos + _ZSTD_HEADER]).content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > room:
        raise body_too_large(limit)
    frame = dctx.decompressobj()
    out: list[bytes] = []
    size = 0

    def within() -> int:  # compressed bytes that decode within the room left
        return (room - size) // ZSTD_MAX_RATIO

    unknown = declared == zstandard.CONTENTSIZE_UNKNOWN
    for piece, end in _feed(view, pos, within if unknown else None):
        got = frame.decompress(piece)
        size += len(got)
        if size > room:
            raise body_too_large(limit)
        out.append(got)
        if frame.eof:  # its leftover is at most this slice (:func:`_feed`)
            return out, end - len(frame.unused_data)
    raise Invalid("it ends early")


def _zstd(body: bytes, limit: int) -> list[bytes]:
    dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
    view = memoryview(body)
    parts: list[bytes] = []
    pos = size = frames = 0
    try:
        while pos < len(body) or not frames:  # frame after frame (RFC 8878 § 3: a stream of frames)
            frames += 1
            _count(frames, "zstd frames")
            out, pos = _zstd_frame(dctx, view, pos, limit - size, limit)
            parts += out
            size += sum(map(len, out))
        return parts
    except zstandard.ZstdError as e:
        raise Invalid(str(e)) from None


#: each encoding read: ``(body, limit)`` → the decoded parts, or the 413 past ``limit`` bytes
DECODERS: dict[str, Callable[[bytes, int], list[bytes]]] = {
    "gzip": _gzip, "x-gzip": _gzip, "deflate": _deflate, "zstd": _zstd,
}  # fmt: skip
#: the most codings one body may list: each may decode up to the bound, so the work is bounded
MAX_CODINGS = 4


def decode(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` as its ``Content-Encoding`` says: a list of codings is undone the last first (RFC
    9110 § 8.4 lists them in the order applied), each step at most ``limit`` bytes decoded (413);
    a coding not read, or more than :data:`MAX_CODINGS` of them, a 415; a body that is not what it
    says a 400."""
    listed = (c.strip().lower() for c in encoding.split(","))
    codings = [c for c in listed if c not in ("", "identity")]
    unread = [c for c in codings if c not in DECODERS]
    if unread or len(codings) > MAX_CODINGS:
        why = f"{unread[0][:40]!r} is" if unread else f"{len(codings)} codings are"
        raise ApiError(415, f"request Content-Encoding {why} not supported: send the body as "
                       f"{', '.join(DECODERS)} (at most {MAX_CODINGS} of them) or not encoded",
                       code="unsupported_content_encoding")  # fmt: skip
    for coding in reversed(codings):
        try:
            body = b"".join(DECODERS[coding](body, limit))
        except Invalid as e:
            raise ApiError(400, f"request body is not valid {coding}: {e}",
                           code="invalid_body_encoding") from None  # fmt: skip
    return body
