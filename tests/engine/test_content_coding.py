"""engine/content_coding.py over real HTTP (the guarded server takes 4000 bytes of body): gzip,
deflate and zstd bodies are decoded within ``max_body_bytes`` of decoded bytes, a body that is not
what its encoding says is a 400, an encoding not read a 415."""

from __future__ import annotations

import httpx
import pytest

from tests.serving import AUTH


def test_a_compressed_body_is_read_as_its_content_encoding_says(guarded):
    """A gzip (or deflate) body, as Codex-style clients send large /v1/responses bodies, was a 400
    "not valid JSON: can't decode byte 0x8b"; it is decoded now, within ``max_body_bytes`` of
    decoded bytes (a small bomb is a 413), and an encoding the server cannot read is a 415."""
    import gzip
    import json
    import zlib

    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()

    def post(body: bytes, encoding: str) -> httpx.Response:
        headers = {**AUTH, "content-type": "application/json", "content-encoding": encoding}
        return httpx.post(guarded.url + "/v1/chat/completions", content=body, headers=headers,
                          timeout=60)  # fmt: skip

    for body, encoding in ((gzip.compress(raw), "gzip"), (zlib.compress(raw), "deflate"),
                           (raw, "identity")):  # fmt: skip
        r = post(body, encoding)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", (encoding, r.text)
    r = post(raw, "br")
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content_encoding"
    assert "zstd" in r.json()["error"]["message"]  # the encodings it reads are named
    r = post(gzip.compress(raw)[:-9], "gzip")  # cut short
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body_encoding", r.text
    bomb = gzip.compress(json.dumps({"messages": [{"role": "user", "content": " " * 50_000}]}).encode())
    assert len(bomb) < 4000
    r = post(bomb, "gzip")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def _post(server, body: bytes, encoding: str) -> httpx.Response:
    headers = {**AUTH, "content-type": "application/json", "content-encoding": encoding}
    url = server.url + "/v1/chat/completions"
    return httpx.post(url, content=body, headers=headers, timeout=60)


def _chat(body: bytes, encoding: str, status: int, code: str | None, server) -> None:
    r = _post(server, body, encoding)
    assert r.status_code == status, (encoding, r.text)
    if code:
        assert r.json()["error"]["code"] == code, r.text
    else:
        assert r.json()["object"] == "chat.completion", r.text


_RAW = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


def test_a_zstd_body_is_read_within_the_decoded_bound(guarded):
    """``Content-Encoding: zstd`` (Codex-style clients compress their bodies so) was a 415. It is
    decoded now, all its frames (RFC 8878), within ``max_body_bytes`` of decoded bytes (a bomb
    is a 413); a damaged, cut or trailing-junk frame, or one asking for a window past the 8 MiB
    HTTP allows (RFC 9659), is a 400 ``invalid_body_encoding``."""
    import zstandard

    z = zstandard.ZstdCompressor()
    frame = z.compress(_RAW)
    half = len(_RAW) // 2
    _chat(frame, "zstd", 200, None, guarded)
    _chat(z.compress(_RAW[:half]) + z.compress(_RAW[half:]), "zstd", 200, None, guarded)
    _chat(frame[:-4], "zstd", 400, "invalid_body_encoding", guarded)  # cut short
    _chat(frame + b"junk", "zstd", 400, "invalid_body_encoding", guarded)
    _chat(b"not zstd at all", "zstd", 400, "invalid_body_encoding", guarded)
    bomb = z.compress(b" " * 50_000_000)
    assert len(bomb) < 4000
    _chat(bomb, "zstd", 413, "request_too_large", guarded)
    # streamed (no content size in the header) with a 16 MiB window
    wide = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        window_log=24)).compressobj()  # fmt: skip
    _chat(wide.compress(_RAW) + wide.flush(), "zstd", 400, "invalid_body_encoding", guarded)


def test_gzip_members_trailing_junk_and_raw_deflate(guarded):
    """A gzip body of several members (RFC 1952: one stream) was read to the end of the first
    (here: half a JSON document, a 400); bytes after the stream were ignored (a 200); a raw
    deflate body (no zlib wrapper, as some clients send ``deflate``) was a 400."""
    import gzip
    import zlib

    half = len(_RAW) // 2
    _chat(gzip.compress(_RAW[:half]) + gzip.compress(_RAW[half:]), "gzip", 200, None, guarded)
    _chat(gzip.compress(_RAW) + b"junk", "gzip", 400, "invalid_body_encoding", guarded)
    _chat(gzip.compress(_RAW) + b"\x1f\x8b", "gzip", 400, "invalid_body_encoding", guarded)
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    _chat(raw.compress(_RAW) + raw.flush(), "deflate", 200, None, guarded)
    _chat(zlib.compress(_RAW) + b"junk", "deflate", 400, "invalid_body_encoding", guarded)
    _chat(b"neither form", "deflate", 400, "invalid_body_encoding", guarded)
    bomb = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    bomb_body = bomb.compress(b" " * 1_000_000) + bomb.flush()
    _chat(bomb_body, "deflate", 413, "request_too_large", guarded)
    _chat(gzip.compress(_RAW) + gzip.compress(b" " * 1_000_000), "gzip", 413, "request_too_large",
          guarded)  # fmt: skip


def test_stacked_codings_are_undone_last_applied_first(guarded):
    """``Content-Encoding: gzip, zstd`` (RFC 9110 § 8.4: the codings in the order applied) was a
    415 naming the whole list; each coding is undone now, the last first, every step within
    ``max_body_bytes`` of decoded bytes (a bomb under an outer coding is a 413). A coding not read
    anywhere in the list is still a 415, and so is a list of more than 4 codings (each step may
    decode up to the bound); the list in the wrong order is a 400."""
    import gzip
    import zlib

    import zstandard

    z = zstandard.ZstdCompressor()
    _chat(z.compress(gzip.compress(_RAW)), "gzip, zstd", 200, None, guarded)
    _chat(gzip.compress(zlib.compress(_RAW)), "deflate,gzip", 200, None, guarded)
    _chat(gzip.compress(_RAW), "identity, gzip", 200, None, guarded)
    _chat(gzip.compress(_RAW), "gzip, br", 415, "unsupported_content_encoding", guarded)
    _chat(gzip.compress(_RAW), "br, gzip", 415, "unsupported_content_encoding", guarded)
    _chat(z.compress(gzip.compress(_RAW)), "zstd, gzip", 400, "invalid_body_encoding", guarded)
    bomb = gzip.compress(b" " * 1_000_000)  # within the bound as sent, not once the gzip is undone
    assert len(z.compress(bomb)) < 4000
    _chat(z.compress(bomb), "gzip, zstd", 413, "request_too_large", guarded)
    deep = _RAW
    for _ in range(5):  # past the 4 codings undone
        deep = gzip.compress(deep)
    _chat(deep, ", ".join(["gzip"] * 5), 415, "unsupported_content_encoding", guarded)


class _Counted:
    """A real decoder (zlib's or zstandard's) that adds the compressed bytes handed to it to
    ``fed``."""

    def __init__(self, inner, fed: list[int]) -> None:
        self._inner, self._fed = inner, fed

    def decompress(self, data, *args):
        self._fed[0] += len(data)
        return self._inner.decompress(data, *args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_body_of_many_small_members_or_frames_is_read_in_linear_work(monkeypatch):
    """Each gzip member's (zstd frame's) decoder was handed everything left of the body, and kept
    a copy of what followed its stream: a body of many small members cost the square of its
    size (a 2 MiB body of empty gzip members took 2.5 s of a worker thread, zstd 5.6 s; the
    16 MiB ``max_body_bytes`` minutes). The compressed bytes handed to the decoders now stay
    within a small multiple of the body."""
    import gzip
    import zlib

    import zstandard

    from engine import content_coding

    fed = [0]
    real_inflate, real_zstd = zlib.decompressobj, zstandard.ZstdDecompressor

    class Zstd:  # wraps the real one (a subclass of the C type crashed a later garbage collection)
        def __init__(self, **kwargs):
            self._real = real_zstd(**kwargs)

        def stream_reader(self, *args, **kwargs):
            return self._real.stream_reader(*args, **kwargs)

        def decompressobj(self, *args, **kwargs):
            return _Counted(self._real.decompressobj(*args, **kwargs), fed)

    monkeypatch.setattr(content_coding.zlib, "decompressobj",
                        lambda *a: _Counted(real_inflate(*a), fed))  # fmt: skip
    monkeypatch.setattr(content_coding.zstandard, "ZstdDecompressor", Zstd)
    n = content_coding.MAX_STREAMS  # as many as a body may have
    for unit, encoding in ((gzip.compress(b"{}", mtime=0), "gzip"),
                           (zstandard.ZstdCompressor().compress(b"{}"), "zstd")):  # fmt: skip
        fed[0] = 0
        body = unit * n
        assert content_coding.decode(body, encoding, 1 << 20) == b"{}" * n
        # each member is handed 256 bytes at first, twice as many each time it asks for more
        assert fed[0] <= 2 * len(body) + 2 * 256 * n, (encoding, fed[0], len(body))


def test_a_body_of_more_members_or_frames_than_a_client_sends_is_refused():
    """Each gzip member or zstd frame costs a decoder: 16 MiB of empty members took 1.3-2.3 s of a
    worker thread per request. A body of more than ``MAX_STREAMS`` of them is a 400
    ``invalid_body_encoding``; as many is read."""
    import gzip

    import zstandard

    from engine import content_coding
    from engine.errors import ApiError

    n = content_coding.MAX_STREAMS
    z = zstandard.ZstdCompressor()
    for encoding, piece in (("gzip", lambda b: gzip.compress(b, mtime=0)), ("zstd", z.compress)):
        body = piece(_RAW) + piece(b"") * (n - 1)
        assert content_coding.decode(body, encoding, 1 << 20) == _RAW
        with pytest.raises(ApiError) as e:
            content_coding.decode(body + piece(b""), encoding, 1 << 20)
        assert (e.value.status, e.value.code) == (400, "invalid_body_encoding"), encoding


def test_a_zstd_body_is_decoded_once_within_the_bound(monkeypatch):
    """A zstd body was decoded twice: once by zstandard's stream reader to measure it (it bounds its
    output but passes a cut frame as an end), then again frame by frame. It is decoded once now,
    the bound still held: a frame that declares a size past it is refused undecoded, a streamed
    one (no size declared) is refused within a block of the bound."""
    import zstandard

    from engine import content_coding
    from engine.errors import ApiError

    decoded = [0]
    real_zstd = zstandard.ZstdDecompressor

    class Out:  # a real decoder (reader or frame decoder) adding what it decodes to ``decoded``
        def __init__(self, inner) -> None:
            self._inner = inner

        def decompress(self, data):
            out = self._inner.decompress(data)
            decoded[0] += len(out)
            return out

        def read(self, n=-1):
            out = self._inner.read(n)
            decoded[0] += len(out)
            return out

        def __enter__(self):
            self._inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    class Zstd:  # wraps the real one (a subclass of the C type crashed a later garbage collection)
        def __init__(self, **kwargs):
            self._real = real_zstd(**kwargs)

        def stream_reader(self, *args, **kwargs):
            return Out(self._real.stream_reader(*args, **kwargs))

        def decompressobj(self, *args, **kwargs):
            return Out(self._real.decompressobj(*args, **kwargs))

    monkeypatch.setattr(content_coding.zstandard, "ZstdDecompressor", Zstd)
    z = zstandard.ZstdCompressor()
    text = b"".join(b"%d words, " % i for i in range(100_000))
    streamed = z.compressobj()
    for body in (z.compress(text), streamed.compress(text) + streamed.flush()):
        decoded[0] = 0
        assert content_coding.decode(body, "zstd", 1 << 24) == text
        assert decoded[0] == len(text)
    limit = 1 << 20
    declared = z.compress(b" " * 50_000_000)
    streamed = z.compressobj()
    bomb = streamed.compress(b" " * 50_000_000) + streamed.flush()
    for body, most in ((declared, 0), (bomb, limit + 128 * 1024)):
        decoded[0] = 0
        with pytest.raises(ApiError) as e:
            content_coding.decode(body, "zstd", limit)
        assert e.value.status == 413 and decoded[0] <= most, (decoded[0], most)
