"""A .gguf file given as a model, converted once: dequantizing a GGUF into a torch model takes about a minute even
for a few hundred million parameters, and a command on it would pay that before its first output every time. The
fp32 safetensors folder `registry.convert_gguf` makes of it is kept in the cache under `gguf/<sha256 of the file>`
(the content's hash, read in chunks: a file edited or replaced in place is a new entry, a copy elsewhere finds the
old one), written atomically with its provenance in `source.json`; a lock in the cache lets one of two commands on
the same new file convert it while the other waits. An entry is used only when it holds together: a directory of
this user's, writable by no one else, whose `source.json` names the same hash and whose listed files are all there;
anything else there is converted again over it.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from importlib.metadata import version
from pathlib import Path

import torch

from bitquilt import cache
from bitquilt.models import registry

SOURCE = "source.json"


def entry(digest: str) -> Path:
    """The cache folder of the GGUF whose sha256 is `digest` (created or not)."""
    return cache.cache_dir() / "gguf" / digest


def is_valid(folder: Path, digest: str) -> bool:
    """Whether `folder` is a finished conversion of the GGUF with sha256 `digest` that only this user could write."""
    try:
        st = folder.lstat()
        source = json.loads((folder / SOURCE).read_text())
    except (OSError, ValueError):
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False
    files = cache.written_entries(folder)
    return (isinstance(source, dict) and source.get("gguf_sha256") == digest and files is not None
            and all((folder / name).is_file() for name in files))


def converted(gguf: Path) -> Path:
    """The fp32 safetensors folder of the GGUF file `gguf`, converted now unless the cache holds it."""
    digest = cache.sha256_file(gguf)
    folder = entry(digest)
    folder.parent.mkdir(mode=0o700, exist_ok=True)
    with cache.file_lock(f"gguf-{digest[:16]}"):
        if is_valid(folder, digest):
            return folder
        print(f"bitquilt: converting {gguf.name} to fp32 safetensors, once: kept in {folder} (by its sha256)",
              file=sys.stderr, flush=True)
        with cache.atomic_dir(folder) as tmp:
            registry.convert_gguf(gguf, tmp)
            (tmp / SOURCE).write_text(json.dumps({
                "gguf_file": str(gguf), "gguf_sha256": digest, "converted_to": "float32 safetensors",
                "versions": {"transformers": version("transformers"), "torch": torch.__version__}}, indent=2) + "\n")
    return folder
