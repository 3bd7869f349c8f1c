"""Publishing a model directory (tiny, smollm2, templates): built whole in a temp directory beside it, then
moved into place with ``os.replace``, so a reader never sees a half-written one and a crash leaves none."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def publish(
    out_dir: Path,
    build: Callable[[Path], None],
    error: type[Exception],
    published: Callable[[], bool] | None = None,
) -> Path:
    """Fill a fresh temp directory beside ``out_dir`` with ``build(tmp)`` and move it into place
    (replacing an older ``out_dir``); returns ``out_dir``.

    ``published()`` true after the build: a concurrent publisher got there first, its directory is kept
    and ours discarded. Raises ``error`` when the temp directory cannot be made; whatever ``build`` raises
    passes through, after the temp directory is removed.
    """
    out_dir = Path(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as e:
        raise error(f"cannot create {out_dir}: {e.strerror or e}") from e
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a model directory is meant to be shared
        if published is not None and published():
            shutil.rmtree(tmp)
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
