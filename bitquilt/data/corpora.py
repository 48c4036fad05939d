"""Plain-text document sets for perplexity and calibration, built from the fetched eval data.

The packaged sets come from different sources so calibration never sees evaluation text:
`wiki` and `lambada` are for perplexity, `coqa` (general, the default) and `sciq` (science) are for
calibration. A user may pass a .txt file (documents separated by blank lines) or a .jsonl file (a
"text" field per line) instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pyarrow.ipc

from bitquilt.data.assets import eval_data_dir, request_records
from bitquilt.errors import UserError


def _arrow_column(rel: str, column: str) -> list[str]:
    files = sorted((eval_data_dir() / "hf_datasets" / rel).glob("*.arrow"))
    if not files:
        raise UserError(f"no arrow files in {eval_data_dir() / 'hf_datasets' / rel}; "
                        "re-fetch with `bitquilt fetch eval-data --force`")
    return [v for f in files for v in pyarrow.ipc.open_stream(f).read_all().column(column).to_pylist()]


def _unique(texts: Iterable[str]) -> list[str]:
    """Stripped, non-empty texts, each kept once, in order of first occurrence."""
    return list(dict.fromkeys(t.strip() for t in texts if t and t.strip()))


def _wiki() -> list[str]:
    return _unique(_arrow_column("boolq/none/validation", "passage"))


def _sciq() -> list[str]:
    return _unique(_arrow_column("sciq/none/validation", "support"))


def _lambada() -> list[str]:
    return _unique(r["request"]["context"] + r["request"]["continuation"]
                   for r in request_records("lambada/bpb_0shot"))


def _coqa() -> list[str]:
    return _unique(r["doc"]["story"] for r in request_records("coqa/bpb_0shot"))


@dataclass(frozen=True)
class TextSet:
    description: str
    load: Callable[[], list[str]]


TEXT_SETS: dict[str, TextSet] = {
    "wiki": TextSet("perplexity: unique Wikipedia passages of BoolQ validation (2,938, 1.6 MB)", _wiki),
    "lambada": TextSet("perplexity: LAMBADA (OpenAI) test passages, book text (5,151, 1.7 MB)", _lambada),
    "sciq": TextSet("calibration: SciQ validation `support` passages, science text (887, 0.4 MB)", _sciq),
    "coqa": TextSet("calibration: CoQA validation stories from five domains: children's stories, school exams, news, "
                    "Wikipedia, literature (499, 0.7 MB)", _coqa),
}
_USER_FORMATS = ".txt (documents separated by blank lines) or .jsonl (one {\"text\": ...} object per line)"


@cache
def _builtin(name: str) -> tuple[str, ...]:
    return tuple(TEXT_SETS[name].load())


def _read_txt(path: Path) -> list[str]:
    return [d.strip() for d in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")) if d.strip()]


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{path}:{i} is not a JSON object with a \"text\" field") from None
            if not isinstance(text, str):
                raise UserError(f"{path}:{i}: \"text\" must be a string")
            if text.strip():
                docs.append(text)
    return docs


READERS = {".txt": _read_txt, ".jsonl": _read_jsonl}


def check_source(source: str | Path) -> Path | None:
    """Raise UserError unless `source` names a packaged text set (TEXT_SETS: None) or an existing .txt / .jsonl file
    (its path): checked before a model is loaded, not when its text is first read."""
    if isinstance(source, str) and source in TEXT_SETS:
        return None
    path = Path(source).expanduser()
    if path.suffix not in READERS:
        raise UserError(f"unknown text source {str(source)!r}; use one of {', '.join(TEXT_SETS)}, "
                        f"or a path to a {_USER_FORMATS} file")
    if not path.is_file():
        raise UserError(f"text file {path} does not exist")
    return path


def load_documents(source: str | Path) -> list[str]:
    """Documents of a packaged text set (see TEXT_SETS) or of a user's .txt / .jsonl file."""
    path = check_source(source)
    if path is None:
        return list(_builtin(str(source)))
    try:
        docs = READERS[path.suffix](path)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}; expected a UTF-8 {_USER_FORMATS} file") from None
    if not docs:
        raise UserError(f"{path} contains no text; expected a {_USER_FORMATS} file")
    return docs


def check_disjoint(calib_source: str | Path, eval_source: str | Path) -> None:
    """Refuse to evaluate on documents the model was calibrated on (that perplexity would be optimistic).

    Compared document by document, so a user file that repeats passages of a packaged set is caught too.
    """
    shared = set(load_documents(calib_source)) & set(load_documents(eval_source))
    if shared:
        raise UserError(f"the evaluation text {str(eval_source)!r} shares {len(shared)} document(s) with the "
                        f"calibration text {str(calib_source)!r}; evaluate on text the model was not calibrated "
                        f"on (packaged: {', '.join(n for n in TEXT_SETS if n != str(calib_source))}) or calibrate "
                        "on another text")
