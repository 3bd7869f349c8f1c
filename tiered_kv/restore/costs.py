"""Learned costs: the engine's own prefills and the cold tier's own reads, fitted and persisted.

A :class:`CostBook` keeps a bounded, diverse set of observations per kind —

* ``prefill`` (k new tokens, c context tokens, seconds) from every prefill the engine runs;
* ``load``  (bytes, seconds, share warm) from every cold reload (read + verify + build arrays);
* ``range`` (bytes, seconds, share warm) from the ranged reads of `both`;
* ``join``  (bytes, seconds) from joining computed and read halves (allocation + join, per byte
  of the whole restored prefix);
* ``head``  (predicted seconds alone, seconds, the read's share warm) of each `both`'s head,
  computed beside its read;
* ``outcome`` (way, predicted seconds, actual seconds) of every restore taken —

and fits them (non-negative least squares on relative error) into the pure
:class:`~tiered_kv.restore.plan.Learned` that :func:`~tiered_kv.restore.plan.plan` reads.

An observation is only kept when made: the fit runs when :attr:`CostBook.learned` is next read, or
at :meth:`CostBook.settle`, which the engine calls after a request's first token and when its
batch goes idle (a request cancelled before that token), and the calibration at its end. A
restore's own observations (its load; a `both`'s head, range read and join) are made before that
token, and each refit and the first write of the file after a restart had run inside its TTFT.

Persistence: one JSON file per (model fingerprint, machine) in the cold tier's directory, written
atomically (temp + ``os.replace``) by :meth:`CostBook.settle`, at most every ``save_every`` seconds,
and at close. A missing,
unreadable or foreign file starts empty (logged once): it is advice, never code (no pickle).

Threads: the engine thread observes and plans; ``stats()`` may be read from a metrics scrape, so
the fitted snapshot is swapped in whole (a scrape sees the old or the new one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from tiered_kv.cold import backend, fsafe
from tiered_kv.restore.plan import WARM, Learned, PrefillCost, ReadCost

log = logging.getLogger(__name__)
#: 2: join observations are per byte of the restored prefix (were: per byte read, of a slower join).
#: A head row of two numbers (before its read's share warm was kept) counts as beside a cold read.
VERSION = 2
KINDS = ("prefill", "load", "range", "join", "head", "outcome")
WAYS = ("load", "compute", "both")  # an outcome's way is stored as its index + 1
_PER_BUCKET = 3  # observations kept per size bucket: recent ones, spread over sizes
_MAX_PER_KIND = 192
_MAX_FILE_BYTES = 4 << 20  # what it holds is a few hundred short rows


def machine_id(device: str = "") -> tuple[str, dict[str, Any]]:
    """(short id, description) of this machine: host, CPU, core count and the MLX device."""
    desc = {
        "node": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count() or 0,
        "device": device,
    }
    raw = json.dumps(desc, sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()[:16], desc


_MAX_TOKENS, _MAX_BYTES, _MAX_SECONDS = 1e9, 1e15, 1e6  # beyond any real observation
_MAX_TOKENS_PER_S, _MAX_BYTES_PER_S = 1e8, 1e12  # nor does a prefill or a read run faster


def valid(kind: str, obs: list[float]) -> bool:
    """An observation a real prefill, read or restore can make: finite, positive sizes and
    seconds within bounds no machine reaches (a planted or damaged file's rows made the fit
    overflow or ``log2`` fail: a server that did not start, or a worker that died)."""
    sizes = {"join": (2,), "head": (2, 3)}.get(kind, (3,))
    if len(obs) not in sizes or not all(math.isfinite(x) for x in obs):
        return False
    if kind == "prefill":
        k, c, sec = obs
        return (0 < k <= _MAX_TOKENS and 0 <= c <= _MAX_TOKENS and 0 < sec <= _MAX_SECONDS
                and k / sec <= _MAX_TOKENS_PER_S)  # fmt: skip
    if kind == "outcome":
        way, predicted, actual = obs
        return way in (1, 2, 3) and 0 < predicted <= _MAX_SECONDS and 0 < actual <= _MAX_SECONDS
    if kind == "head":
        return all(0 < x <= _MAX_SECONDS for x in obs[:2]) and (len(obs) == 2 or -1 <= obs[2] <= 1)
    ok = 0 < obs[0] <= _MAX_BYTES and 0 < obs[1] <= _MAX_SECONDS and obs[0] / obs[1] <= _MAX_BYTES_PER_S
    return ok and (kind == "join" or -1 <= obs[2] <= 1)


def _row(r: Any) -> list[float] | None:
    """A row of the file as floats, or None (not a list of numbers, or past float)."""
    if not (isinstance(r, list) and all(isinstance(x, (int, float)) for x in r)):
        return None
    try:
        return [float(x) for x in r]
    except OverflowError:
        return None


def _bucket(kind: str, obs: list[float]) -> tuple[int, ...]:
    if kind == "outcome":
        return (int(obs[0]), round(math.log2(max(obs[1] * 1e3, 1))))
    if kind == "head":
        return (round(math.log2(max(obs[0] * 1e3, 1))), int(_beside_warm(obs)))
    if kind == "prefill":
        k, c = obs[0], obs[1]
        return (round(math.log2(max(k, 1))), round(math.log2(c + 1)))
    warm = int(obs[2] >= WARM) if len(obs) > 2 else 0
    return (round(math.log2(max(obs[0], 1))), warm)


def fit(
    features: np.ndarray, seconds: np.ndarray, prefer: list[tuple[int, ...]]
) -> np.ndarray | None:
    """Non-negative coefficients over ``features`` minimising the relative error of ``seconds``.

    Tries the column subsets in ``prefer`` (simplest first) and keeps a richer one only when it
    cuts the residual by 10 %: few, similar observations then give a plain rate, not a wild split.
    """
    if len(seconds) == 0:
        return None
    w = 1.0 / np.maximum(seconds, 1e-6)
    a, b = features * w[:, None], seconds * w
    best: np.ndarray | None = None
    best_res = math.inf
    for cols in prefer:
        sub = a[:, list(cols)]
        coef, *_ = np.linalg.lstsq(sub, b, rcond=None)
        if np.any(coef < 0) or not np.all(np.isfinite(coef)):
            continue
        res = float(np.sum((sub @ coef - b) ** 2))
        if best is None or res < 0.9 * best_res - 1e-12:
            full = np.zeros(features.shape[1])
            full[list(cols)] = coef
            best, best_res = full, res
    if best is None or not np.any(best > 0):
        return None
    return best


def corrections(outcomes: list[list[float]]) -> tuple[tuple[str, float, float], ...]:
    """The outcomes as ``(way, predicted seconds, actual / predicted)``: ``Learned.factor`` takes
    the median of those near a plan's size."""
    return tuple((WAYS[int(r[0]) - 1], r[1], r[2] / r[1]) for r in outcomes if r[1] > 0)


def _beside_warm(head: list[float]) -> bool:
    """Whether a head row's read was of a page-cache-warm file (a row of two numbers, written
    before the share was kept, or an unknown share: cold)."""
    return len(head) > 2 and head[2] >= WARM


def head_factor(heads: list[list[float]], warm: bool = False) -> float | None:
    """How much slower a `both`'s head computes than the same prefill alone beside a read of a
    page-cache-``warm`` file (or a cold one): the median of actual / predicted over those heads
    (None before one; ``plan`` clamps it). Apart, for the two differ: on the H100 a head beside a
    cold read (the disk's 1-2 GB/s) computed as fast as alone (0.93-1.08x, 1B and 8B, 8k-128k),
    beside a warm one (the page cache's 10-25 GB/s copied to the GPU) 1.2-2.0x slower."""
    ratios = [r[1] / r[0] for r in heads if r[0] > 0 and _beside_warm(r) == warm]
    return float(np.median(ratios)) if ratios else None


def fastest_per_bucket(kind: str, obs: list[list[float]]) -> list[list[float]]:
    """The fastest observation of each size bucket (seconds per token, per byte): what the machine
    can do. A slower one of the same shape was slowed by something else — first-call costs
    (kernel compiles, a process's first allocations), a loaded machine — and would teach a slow
    machine: a prefill so on a GPU chose `both` where compute was 2x faster, a process's first
    warm load (0.30 s against 0.045 s after) chose `both` where the load was faster."""
    size, seconds = 0, (2 if kind == "prefill" else 1)  # [k, c, s] / [bytes, s, warm share]
    best: dict[tuple[int, ...], list[float]] = {}
    for o in obs:
        key = _bucket(kind, o)
        if key not in best or o[seconds] / o[size] < best[key][seconds] / best[key][size]:
            best[key] = o
    return list(best.values())


_PREFILL_SUBSETS = [(1,), (0, 1), (1, 2), (0, 1, 2), (2,), (0, 2)]
_READ_SUBSETS = [(1,), (0, 1)]


def fit_prefill(obs: list[list[float]]) -> PrefillCost | None:
    if not obs:
        return None
    o = np.asarray(obs, dtype=np.float64)
    k, c, s = o[:, 0], o[:, 1], o[:, 2]
    feats = np.stack([np.ones_like(k), k, k * (c + k / 2)], axis=1)
    coef = fit(feats, s, _PREFILL_SUBSETS)
    if coef is None or coef[1] + coef[2] <= 0:
        return None
    return PrefillCost(float(coef[0]), float(coef[1]), float(coef[2]))


def fit_read(obs: list[list[float]]) -> ReadCost | None:
    if not obs:
        return None
    o = np.asarray(obs, dtype=np.float64)
    feats = np.stack([np.ones(len(o)), o[:, 0]], axis=1)
    coef = fit(feats, o[:, 1], _READ_SUBSETS)
    if coef is None or coef[1] <= 0:
        return None
    return ReadCost(float(coef[0]), float(1.0 / coef[1]))


class CostBook:
    """Observations of one model on one machine, their fit, and their file (see module doc)."""

    def __init__(self, path: Path | None, fingerprint: str = "", device: str = "",
                 save_every: float = 2.0) -> None:  # fmt: skip
        self.path = path
        self.fingerprint = fingerprint
        self.machine, self.machine_desc = machine_id(device)
        self.save_every = save_every
        self.obs: dict[str, list[list[float]]] = {k: [] for k in KINDS}
        self._dirty = False  # observations not saved yet
        self._stale = False  # observations not fitted yet
        self._saved_at = 0.0
        self._learned = Learned()
        if path is not None:
            self._read(path)
        self._refit()

    @staticmethod
    def file_for(directory: Path, device: str = "") -> Path:
        return Path(directory) / f"costs-{machine_id(device)[0]}.json"

    # -- observing ---------------------------------------------------------------------------
    def observe_prefill(self, new_tokens: int, context: int, seconds: float) -> None:
        if new_tokens > 0 and seconds > 0:
            self._add("prefill", [float(new_tokens), float(context), seconds])

    def observe_load(self, nbytes: int, seconds: float, warm: float | None) -> None:
        if nbytes > 0 and seconds > 0:
            self._add("load", [float(nbytes), seconds, -1.0 if warm is None else warm])

    def observe_range(self, nbytes: int, seconds: float, warm: float | None) -> None:
        if nbytes > 0 and seconds > 0:
            self._add("range", [float(nbytes), seconds, -1.0 if warm is None else warm])

    def observe_outcome(self, way: str, predicted: float, actual: float) -> None:
        """A restore by ``way`` predicted (before correction) and actually taking these seconds."""
        if way in WAYS and predicted > 0 and actual > 0:
            self._add("outcome", [float(WAYS.index(way) + 1), predicted, actual])

    def observe_join(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._add("join", [float(nbytes), seconds])

    def observe_head(self, predicted: float, seconds: float, warm: float | None = None) -> None:
        """A `both`'s head predicted (alone, by the prefill fit) and actually taking these seconds,
        beside a read of a file with share ``warm`` in the page cache (None: not known)."""
        if predicted > 0 and seconds > 0:
            self._add("head", [predicted, seconds, -1.0 if warm is None else warm])

    def _add(self, kind: str, obs: list[float]) -> None:
        if not valid(kind, obs):
            return
        rows = self.obs[kind]
        key = _bucket(kind, obs)
        same = [i for i, r in enumerate(rows) if _bucket(kind, r) == key]
        if len(same) >= _PER_BUCKET:
            rows.pop(same[0])  # the oldest of its bucket: recent, but still spread over sizes
        rows.append(obs)
        if len(rows) > _MAX_PER_KIND:
            rows.pop(0)
        self._dirty = self._stale = True

    def settle(self) -> None:
        """Fit what was observed since the last fit and save it (throttled). After a request's
        first token: 1.4 ms on a 2-core CPU for a book of a few hundred rows, its first save after
        a restart included, that had run inside the TTFT of every restore."""
        if self._stale:
            self._refit()
        self.save()

    # -- fitting -----------------------------------------------------------------------------
    def _refit(self) -> None:
        self._stale = False
        try:
            self._learned = self._fitted()
        except (ArithmeticError, ValueError, np.linalg.LinAlgError) as e:
            log.warning("restore costs could not be fitted, starting afresh: %s", e)
            self.obs = {k: [] for k in KINDS}
            self._learned = Learned()

    def _fitted(self) -> Learned:
        def reads(kind: str, warm: bool) -> ReadCost | None:
            rows = [r for r in self.obs[kind] if (r[2] >= WARM) == warm]
            if warm:  # a copy out of the page cache: the machine's speed, as a prefill's
                rows = fastest_per_bucket(kind, rows)
            # a cold read's speed is the disk's, which varies with what else reads it: all of them
            return fit_read([r[:2] for r in rows])

        join = [r for r in self.obs["join"]]
        join_bw = sum(r[0] for r in join) / sum(r[1] for r in join) if join else None
        return Learned(
            prefill=fit_prefill(fastest_per_bucket("prefill", self.obs["prefill"])),
            load_cold=reads("load", False),
            load_warm=reads("load", True),
            range_cold=reads("range", False),
            range_warm=reads("range", True),
            join_bytes_per_s=join_bw,
            head_factor=head_factor(self.obs["head"]),
            head_factor_warm=head_factor(self.obs["head"], warm=True),
            correction=corrections(self.obs["outcome"]),
        )

    @property
    def learned(self) -> Learned:
        """The fit of every observation (fitted now if some came since). Engine thread."""
        if self._stale:
            self._refit()
        return self._learned

    def stats(self) -> dict[str, float]:
        """Learned rates for /metrics: prefill tok/s (1k tokens on an empty context), GB/s."""
        le = self._learned
        out: dict[str, float] = {
            "prefill_tok_s": le.prefill.tokens_per_second() if le.prefill else 0.0,
            "prefill_tok_s_at_32k": le.prefill.tokens_per_second(1024, 32768)
            if le.prefill
            else 0.0,
        }
        for name in ("load_cold", "load_warm", "range_cold", "range_warm"):
            cost: ReadCost | None = getattr(le, name)
            out[f"{name}_gb_s"] = cost.bytes_per_s / 1e9 if cost else 0.0
        out["join_gb_s"] = (le.join_bytes_per_s or 0.0) / 1e9
        out["head_factor"] = le.head_slower(0.0)  # as plans use them
        out["head_factor_warm"] = le.head_slower(1.0)
        for way in WAYS:
            out[f"correction_{way}"] = le.factor(way)
        for kind in KINDS:
            out[f"{kind}_observations"] = float(len(self.obs[kind]))
        return out

    # -- persistence -------------------------------------------------------------------------
    def _read(self, path: Path) -> None:
        try:  # a regular file of ours, small (a planted FIFO, link or deep nesting is refused)
            raw = json.loads(fsafe.read_file(path, _MAX_FILE_BYTES))
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as e:
            log.warning("restore costs %s unreadable, starting afresh: %s", path, e)
            return
        try:
            if raw.get("version") != VERSION or raw.get("fingerprint") != self.fingerprint:
                return  # another format or model: start afresh
            for kind in KINDS:
                rows = raw.get("observations", {}).get(kind, [])
                kept = [_row(r) for r in rows]
                self.obs[kind] = [r for r in kept if r is not None and valid(kind, r)][-_MAX_PER_KIND:]
        except (AttributeError, TypeError, ValueError, OverflowError) as e:
            log.warning("restore costs %s malformed, starting afresh: %s", path, e)
            self.obs = {k: [] for k in KINDS}

    def save(self, force: bool = False) -> None:
        """Write the file if something changed (throttled unless ``force``). Errors are logged:
        losing advice costs a calibration, never a request."""
        if self.path is None or not self._dirty:
            return
        now = time.monotonic()
        if not force and now - self._saved_at < self.save_every:
            return
        body = {"version": VERSION, "fingerprint": self.fingerprint, "machine": self.machine_desc,
                "observations": self.obs}  # fmt: skip
        tmp = backend.temp_path(self.path, os.getpid())  # swept as the entries' when its writer died
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("restore costs not saved to %s: %s", self.path, e)
            tmp.unlink(missing_ok=True)
            return
        self._dirty = False
        self._saved_at = now


__all__ = ["CostBook", "corrections", "fastest_per_bucket", "head_factor", "fit_prefill", "fit_read", "machine_id", "valid"]
