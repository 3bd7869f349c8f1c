"""The write path of the cold tier (writer thread only): budget, bytes, publish, index commit.

One entry is written as: make room (evicting LRU entries through ``evict.Remover``) → encode and
``backend.put`` in one pass (each data byte made once, written with large sequential writes and
hashed on the pool as it goes by; then the header with those checksums over its reserved first
bytes, one fsync, atomic rename, directory fsync) → one index transaction
that adds the record and removes the older entries it continues → delete those files. A failure
anywhere is counted by kind (:class:`faults.Faults`), logged once, and leaves no temp file.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiered_kv import declared, keys, policy
from tiered_kv.cold import encode, store
from tiered_kv.cold.codec import Prepared
from tiered_kv.cold.dbfile import IndexUnreadable
from tiered_kv.cold.evict import Remover
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Record, damaged
from tiered_kv.cold.site import Site
from tiered_kv.prefix import common_prefix, entry_prompt_len
from tiered_kv.shared.publisher import map_file  # [shared tier, issue 17]


@dataclass(frozen=True)
class Raw:
    """[shared tier, issue 17] An entry's bytes as fetched (and verified) from the shared tier:
    written as they are, superseding nothing, not published again."""

    tokens: np.ndarray
    data: bytearray
    metadata: dict[str, str]  # its checked header's

    @property
    def nbytes(self) -> int:
        return len(self.data)


#: [shared tier] hook(read, tokens, nbytes) after each committed entry; read() → its bytes | None
Published = Callable[[Callable[[], Any], np.ndarray, int], None]


class WritePath:
    def __init__(self, site: Site, remover: Remover) -> None:
        self.site = site
        self.remover = remover
        self.published: Published | None = None  # [shared tier, issue 17]

    def write(self, job: Prepared | Raw) -> None:
        """Write one entry; a directory deleted under the write is re-created, an index damaged
        under it rebuilt from the files, and the write retried once (the entry is not lost)."""
        for attempt in (0, 1):
            try:
                self._write(job)
                return
            except FileNotFoundError as e:
                if attempt == 0 and not self.site.dir.is_dir():
                    continue
                self.site.faults.io_error("spill", e)
            except sqlite3.DatabaseError as e:
                if damaged(e):  # not a database (any more), or rows no writer of ours made
                    self.site.damaged = True  # re-opened (rebuilt from the files) by ensure()
                    if attempt == 0:
                        self.site.faults.count("index_errors")  # found here: counted once, here
                        continue
                self.site.faults.io_error("spill", e)
            except (OSError, sqlite3.Error, IndexUnreadable) as e:
                self.site.faults.io_error("spill", e)
            return

    def _write(self, job: Prepared | Raw) -> None:
        site = self.site
        index = site.ensure()
        if index is None:
            site.faults.count("skipped")
            return
        if not self.remover.make_room(index, len(job.tokens), job.nbytes):
            site.faults.count("skipped")
            return
        key = uuid.uuid4().hex
        if isinstance(job, Raw):  # [shared tier] bytes as they are
            entry = encode.Encoded.whole(job.data)
        else:
            entry = encode.encode(job.tokens, job.tensors, job.metadata)
        nbytes = site.backend.put(key, entry)
        try:
            now = time.time()
            blocks = tuple(site.block_hashes(job.tokens))
            prompt = None if isinstance(job, Raw) else store.prompt_of(job.metadata, len(job.tokens))
            pkey = keys.prompt_key(blocks, entry_prompt_len(len(job.tokens), prompt), site.block_tokens)
            serves = declared.serving(job.metadata)
            rec = Record(key, site.backend.path(key).name, len(job.tokens), nbytes, now, now, blocks,
                         prompt, pkey, serves.trimmable, serves.checkpoints)  # fmt: skip
            older = []
            if not isinstance(job, Raw):  # [shared tier] an adopted entry supersedes nothing
                older = [r.entry_id for r in index.covered_by(list(blocks))
                         if self._supersedes(index, r, job)]  # fmt: skip
            gone = index.add(rec, job.tokens.tobytes(), remove=older)
        except BaseException:
            site.backend.delete(key)  # published but never committed
            raise
        self.remover.files_gone(gone, "superseded")  # continuation: deleted after the commit
        site.faults.count("spills")
        site.faults.count("spill_bytes", nbytes)
        if self.published is not None and not isinstance(job, Raw):  # [shared tier] publish too
            path = site.backend.path(key)
            self.published(lambda: map_file(path), job.tokens, nbytes)

    @staticmethod
    def _supersedes(index: Index, r: Record, job: Prepared) -> bool:
        """The stored ``r`` is redundant beside the new entry: its ids are a prefix of the new
        one's and the new one serves that length, or the new one resent its whole prompt
        (:func:`policy.prompt_resent`; the new entry cut back to any length means the old one
        can be too: one fingerprint, one model, the same layers)."""
        stored = index.tokens(r.entry_id)
        if stored is None or len(stored) == 0:
            return False
        common = common_prefix(stored, job.tokens)
        if common == len(stored):
            return job.serves is None or len(stored) in job.serves
        prompt = entry_prompt_len(len(stored), r.prompt_tokens)
        return policy.prompt_resent(common, prompt, job.serves is None)

    def touch(self, entry_id: str, when: float) -> None:
        index = self.site.index
        if index is None or not self.site.writable:
            return
        try:
            index.touch(entry_id, when)
        except sqlite3.Error as e:
            self.site.faults.once("touch", "cold index touch failed: %s", e)
