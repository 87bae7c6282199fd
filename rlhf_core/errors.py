"""User-facing errors: the CLI prints their message (which names the file/row/key and the fix)
without a traceback. Programming errors stay ordinary exceptions and keep their tracebacks."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional


class RLHFError(Exception):
    """Base of errors caused by input, configuration or on-disk state, not by a bug."""


class DataError(RLHFError):
    """Bad input data (names the file and row)."""


class CheckpointError(RLHFError):
    """A missing, corrupt or incompatible checkpoint (names the file)."""


class DiskFullError(RLHFError):
    """A write failed for want of space (names the file, the free space and what to do)."""


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC / EDQUOT, as an OSError or as safetensors reports it (a SafetensorError whose text
    carries the Rust io error: 'code: 28, kind: StorageFull')."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return type(exc).__name__ == "SafetensorError" and ("StorageFull" in text or "code: 28" in text)


def shown_path(path: str | Path) -> str:
    """``path`` as the OS shows it: a name that is not valid UTF-8 keeps its raw bytes as \\xNN
    escapes (Python holds them as lone surrogates, which cannot be printed)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_space(path: Path) -> str:
    """Free space of the filesystem holding ``path`` (its nearest existing ancestor), as text."""
    for candidate in (path, *path.parents):
        try:
            return f"{human_bytes(shutil.disk_usage(candidate).free)} free"
        except OSError:
            continue
    return "free space unknown"


def disk_full_error(path: Optional[str | Path]) -> DiskFullError:
    """The one-line user error for a write of ``path`` (None: a write whose file is not known) that
    found no space."""
    where = f"writing {shown_path(path)}" if path else "during a write"
    space = free_space(Path(path) if path else Path.cwd()) + ("" if path else " in the current directory")
    return DiskFullError(f"no space left on the device {where} ({space}); free space there (old runs under "
                         "trainer.runs_root, a lower trainer.max_ckpt_to_keep) or point trainer.runs_root at a "
                         "larger disk, then rerun (`rlhf run --resume RUN_DIR` continues a run)")


PROBE_BYTES = 64 * 1024
"""What ``require_writable`` writes and syncs: enough blocks that a full disk says so (an empty file
takes only an inode)."""


def require_writable(directory: Path, doing: str) -> None:
    """Refuse, in one line, a run directory this command could not write: read-only (or not ours
    to write), or on a full disk (``disk_full_error`` with the free space of *its* disk). Found by
    writing and syncing a probe file there, removed again: a resume used to meet this in its lock's
    lease, inside a flow, as Prefect ERROR lines and tracebacks."""
    probe = directory / f".rlhf-write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(directory) from None
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise RLHFError(f"cannot {doing}: run directory {shown_path(directory)} cannot be written ({exc.strerror}); "
                            "the run writes its lock, records and checkpoints there: make it writable, or copy it "
                            "to a writable disk and use the copy") from None
        raise
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


@contextlib.contextmanager
def disk_full_as_user_error(path: Path) -> Iterator[None]:
    """Inside: a disk-full failure becomes ``disk_full_error(path)`` (other errors pass as they are)."""
    try:
        yield
    except Exception as exc:
        if is_disk_full(exc):
            raise disk_full_error(path) from exc
        raise


def first_clause(exc: BaseException) -> str:
    """An error's message up to its first "; " (ours go on to advise, which a caller that says what it
    does instead replaces), else its type's name."""
    return str(exc).split("; ")[0] or type(exc).__name__
