"""tiered_kv/cold/backend.py: the narrow storage interface (put / get / contains / delete)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tiered_kv.cold import codec, encode, store
from tiered_kv.cold.backend import Backend, FileBackend


class DictBackend:
    """What a shared tier on a key-value server would implement: bytes by key."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, entry: encode.Encoded) -> int:
        self.data[key] = bytes(entry.join())  # gathers the pieces, then patches the head in
        return len(self.data[key])

    def get(self, key: str) -> bytearray | None:
        v = self.data.get(key)
        return None if v is None else bytearray(v)

    def contains(self, key: str) -> bool:
        return key in self.data

    def delete(self, key: str) -> None:
        self.data.pop(key, None)


def entry_pieces() -> tuple[encode.Encoded, C.KVCache]:
    c = C.KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, 40, 8)), mx.random.normal((1, 2, 40, 8)))
    job = codec.prepare(np.arange(40, dtype=np.int32), [c], None, "fp")
    return encode.encode(job.tokens, job.tensors, job.metadata), c


@pytest.mark.parametrize("kind", ["file", "dict"])
def test_any_backend_round_trips_an_entry(tmp_path, kind):
    backend = FileBackend(tmp_path) if kind == "file" else DictBackend()
    assert isinstance(backend, Backend)
    enc, c = entry_pieces()
    assert not backend.contains("e1") and backend.get("e1") is None
    n = backend.put("e1", enc)
    assert backend.contains("e1") and n == enc.nbytes
    buf = backend.get("e1")
    assert buf is not None
    header = store.parse_buffer(memoryview(buf), "fp")
    arrays = codec.load_buffer(memoryview(buf), header)
    caches, _ = codec.decode(arrays, header.metadata)
    assert mx.array_equal(caches[0].keys, c.keys[..., :40, :]).item()
    backend.delete("e1")
    backend.delete("e1")  # absent is fine
    assert not backend.contains("e1")


def test_file_backend_put_is_atomic_and_private(tmp_path, monkeypatch):
    import os

    b = FileBackend(tmp_path)
    b.put("e1", entry_pieces()[0])
    assert (tmp_path / "e1.safetensors").stat().st_mode & 0o777 == 0o600

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError):
        b.put("e2", entry_pieces()[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e1.safetensors"]  # no temp left


class Crash(Exception):
    """Stands for the writer dying between the data and the header."""


@pytest.mark.parametrize("where", ["head", "pwrite"])
def test_a_failure_between_data_and_header_publishes_nothing(tmp_path, monkeypatch, where):
    """The header comes last (over its reserved first bytes): a failure after the data is
    written and before the header is in place leaves no file at the key (the old value, when
    there is one, stays whole) and no temp file."""
    import dataclasses
    import os

    b = FileBackend(tmp_path)
    b.put("e1", entry_pieces()[0])
    before = b.path("e1").read_bytes()
    seen: list[int] = []

    def crashing(enc: encode.Encoded) -> encode.Encoded:
        real = enc.head
        assert real is not None

        def head() -> bytes:
            temps = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
            seen.append(sum(p.stat().st_size for p in temps))
            if where == "head":
                raise Crash
            return real()

        return dataclasses.replace(enc, head=head)

    def pwrite(*a, **k):
        raise Crash

    if where == "pwrite":
        monkeypatch.setattr(os, "pwrite", pwrite)
    for key in ("e1", "e2"):  # over an existing value, and at a new key
        enc = entry_pieces()[0]
        with pytest.raises(Crash):
            b.put(key, crashing(enc))
        assert seen[-1] == enc.nbytes  # the data was all written when the header was asked for
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e1.safetensors"]
    assert b.path("e1").read_bytes() == before and not b.contains("e2")


def test_keys_are_never_paths(tmp_path):
    b = FileBackend(tmp_path)
    for bad in ("../x", "a/b", "", ".hidden", "x" * 65):
        with pytest.raises(ValueError):
            b.path(bad)


def test_the_temp_name_a_put_writes_is_the_one_its_parser_reads(tmp_path):
    """``.<name>.<pid>.tmp`` was built in backend.py and parsed again in verify.py: one owner
    now builds it (:func:`backend.temp_path`) and reads it (:func:`backend.temp_writer`); the
    temp file a put writes is one verify lists, named with the writer's pid."""
    import dataclasses
    import os

    from tiered_kv.cold import backend, verify

    b = FileBackend(tmp_path)
    seen: list[tuple[str, int | None, list[str]]] = []
    enc = entry_pieces()[0]
    real = enc.head
    assert real is not None

    def head() -> bytes:
        (temp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
        seen.append((temp.name, backend.temp_writer(temp.name),
                     [p.name for p in verify.temp_files(tmp_path)]))  # fmt: skip
        return real()

    b.put("e1", dataclasses.replace(enc, head=head))
    name = backend.temp_path(b.path("e1"), os.getpid()).name
    assert seen == [(name, os.getpid(), [name])]
    for path, pid in ((tmp_path / "a.b.safetensors", 1), (tmp_path / "x", 4194305)):
        assert backend.temp_writer(backend.temp_path(path, pid).name) == pid
    for other in ("e1.safetensors", ".e1.safetensors.tmp", ".e1.safetensors.x1.tmp",
                  ".e1.safetensors.١٢.tmp", "e1.safetensors.12.tmp", ".e1.12.tmp.new"):  # fmt: skip
        assert backend.temp_writer(other) is None, other
