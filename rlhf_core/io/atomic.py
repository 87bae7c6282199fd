"""Atomic writes: nothing partial is ever visible under a final name.

Every writer goes to a temporary sibling (same directory, so the rename stays on one filesystem),
flushes and fsyncs it, then ``os.replace``s it into place. A crash leaves at most a ``.tmp-*`` file
that readers never look at and ``clean_temporaries`` removes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Optional, Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.errors import disk_full_as_user_error
from rlhf_core.io.timing import CHECKPOINT_WRITE, JSON_WRITE, TABLE_WRITE, timed

TMP_MARK = ".tmp-"


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fault_point(name: str, where: Optional[Path] = None) -> None:
    """Die here (SIGKILL-like, no cleanup) when RLHF_FAULT names this point: used by the
    kill-anywhere tests to prove no partial output survives under its final name. With ``where``
    (the file), ``before_rename:iter_3/guard.json`` also matches: the same point in one iteration.
    ``enospc@POINT`` raises the disk-full OSError there instead (a full disk cannot be made here)."""
    wanted = os.environ.get("RLHF_FAULT")
    if not wanted:
        return
    action, _, point = wanted.rpartition("@")
    if point == name or (where is not None and point == f"{name.rsplit(':', 1)[0]}:{where.parent.name}/{where.name}"):
        if action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where or name))
        os._exit(137)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        with disk_full_as_user_error(path):
            yield tmp
            _finish_file(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _finish_file(tmp: Path, path: Path) -> None:
    """fsync ``tmp`` and move it to ``path``."""
    if tmp.is_file():
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
    fault_point(f"before_rename:{path.name}", path)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    fault_point(f"after_rename:{path.name}", path)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with timed(JSON_WRITE), atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def atomic_write_parquet(path: str | Path, table: pa.Table, schema: pa.Schema | None = None) -> Path:
    """Write ``table`` (cast to ``schema`` when given, so a stage's declared schema is enforced)."""
    if schema is not None:
        table = table.select(schema.names).cast(schema)
    with timed(TABLE_WRITE), atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return Path(path)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``path`` (an old one is removed after
    the new one is in place, so a crash leaves either the old or the new directory, never a mix).
    The caller's writes inside the block count as a checkpoint write (``io.timing``)."""
    with timed(CHECKPOINT_WRITE), _atomic_dir(path) as tmp:
        yield tmp


@contextlib.contextmanager
def _atomic_dir(path: str | Path) -> Iterator[Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    tmp.mkdir()
    try:
        with disk_full_as_user_error(path):
            yield tmp
        seal_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def staging_dir(path: str | Path, token: str) -> Path:
    """The temporary directory beside ``path`` named by ``token`` — a name several processes can
    derive without talking — for a write ``seal_dir`` finishes; a crash's leftover goes as any
    temporary does (``clean_temporaries``). Not created here."""
    path = Path(path)
    return path.with_name(f"{path.name}{TMP_MARK}{token}")


def seal_dir(tmp: Path, path: Path) -> None:
    """Put the finished temporary directory ``tmp`` in place of ``path`` (an old one is removed
    after the new one is in place, so a crash leaves either the old or the new directory)."""
    fault_point(f"before_rename:{path.name}", path)
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}{TMP_MARK}old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_temporaries(directory: str | Path) -> list[Path]:
    """Remove leftovers of interrupted atomic writes under ``directory``; returns what was removed."""
    removed = []
    for p in sorted(Path(directory).rglob(f"*{TMP_MARK}*"), key=lambda p: len(p.parts), reverse=True):
        _remove(p)
        removed.append(p)
    return removed


def clean_leftovers(path: str | Path) -> list[Path]:
    """Remove the leftovers of interrupted atomic writes of ``path`` alone (its ``<name>.tmp-*``
    siblings) whose writer is gone: what a killed writer left beside an output that no resume sweeps
    (``clean_temporaries`` sweeps a whole run directory), such as a killed export's. A sibling named
    by the pid of a live process other than this one is that process's write in progress: kept."""
    path = Path(path)
    prefix = f"{path.name}{TMP_MARK}"
    if not path.parent.is_dir():
        return []
    removed = []
    for p in sorted(path.parent.iterdir()):
        if p.name.startswith(prefix) and not _writer_alive(p.name[len(prefix):]):
            _remove(p)
            removed.append(p)
    return removed


def _writer_alive(suffix: str) -> bool:
    """Whether the temporary named ``<name>.tmp-<suffix>`` may be a live writer's (its pid runs)."""
    pid = suffix.split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()
