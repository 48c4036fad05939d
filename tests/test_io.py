import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import bitquilt
from bitquilt.api import model_nbytes, quantize, save
from bitquilt.errors import UserError
from bitquilt.io import CONFIG_NAME, WEIGHTS_NAME, load_quantized
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from tests.conftest import make_tiny, reload_bit_exact

GPTQ_DEFAULTS = {"damp": 0.01, "block_size": 128, "act_order": True, "static_groups": True, "mse": True}


def _ids(n=4, seqlen=32):
    return torch.randint(0, 320, (n, seqlen), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "method, options", [("gptq", {}), ("gptq", {"static_groups": False}), ("rtn", {}), ("awq", {})]
)
def test_save_load_is_bit_exact(tmp_path, method, options):
    model = make_tiny("qwen2")  # qkv bias: exercises QuantLinear bias round trip
    quantize(model, Recipe(method, w_bits=3, group_size=32, options=options), _ids(), progress=False)
    reload_bit_exact(model, _ids(2), tmp_path / "q")
    qconfig = json.loads((tmp_path / "q" / CONFIG_NAME).read_text())
    assert qconfig["recipe"]["method"] == ("awq+rtn" if method == "awq" else method)
    if method == "gptq":  # the resolved options, defaults included (act-order + static groups)
        assert qconfig["recipe"]["options"] == {**GPTQ_DEFAULTS, **options}
    assert len(qconfig["layers"]) == 14 and qconfig["versions"]["torch"]


def test_saved_size_matches_format_bytes(tmp_path):
    model = make_tiny("llama")
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), _ids(), progress=False)
    save(model, tmp_path / "q")
    packed = sum(m.fmt.nbytes() for m in model.modules() if isinstance(m, QuantLinear))
    dense = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights appear once
    file_size = (tmp_path / "q" / WEIGHTS_NAME).stat().st_size
    assert model_nbytes(model) == packed + dense  # tied head counted once
    assert 0 <= file_size - model_nbytes(model) < 16_384  # safetensors header only


def test_save_is_atomic_and_refuses_to_overwrite(tmp_path, monkeypatch):
    model = make_tiny("llama")
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
    import bitquilt.io as bio

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(bio, "write_tensors", broken)
    with pytest.raises(OSError, match="disk full"):
        save(model, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
    monkeypatch.undo()
    save(model, tmp_path / "q")
    with pytest.raises(UserError, match="already exists"):
        save(model, tmp_path / "q")


def test_an_output_never_replaces_its_input_or_the_working_directory(tmp_path, monkeypatch):
    from bitquilt.io import check_output

    source = tmp_path / "models" / "saved"
    source.mkdir(parents=True)
    for output in (source, source.parent, tmp_path):  # the input itself, or a directory holding it
        with pytest.raises(UserError, match="is or holds the input .*which writing it would delete"):
            check_output(output, overwrite=True, source=source)
    check_output(tmp_path / "elsewhere", overwrite=True, source=source)
    monkeypatch.chdir(source)
    with pytest.raises(UserError, match="is or holds the working directory"):
        check_output(".", overwrite=True)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory; give a directory path"):
        check_output(tmp_path / "afile", overwrite=True)


def test_the_command_line_turns_failed_writes_and_interrupts_into_one_line(capsys, monkeypatch):
    from safetensors import SafetensorError

    from bitquilt.errors import run_command

    def raising(error):
        def work() -> int:
            raise error
        return work

    assert run_command("bq", raising(UserError("bad flag"))) == 2
    assert capsys.readouterr().err == "bq: error: bad flag\n"
    assert run_command("bq", raising(OSError(28, "No space left on device"))) == 1
    assert "reading or writing a file failed" in capsys.readouterr().err
    assert run_command("bq", raising(SafetensorError("I/O error: File too large"))) == 1
    assert "File too large" in capsys.readouterr().err
    assert run_command("bq", raising(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err == "interrupted\n"
    with open(os.devnull, "w") as devnull:  # a stdout with a descriptor (pytest's captured one has none)
        monkeypatch.setattr(sys, "stdout", devnull)
        assert run_command("bq", raising(BrokenPipeError())) == 141
    assert capsys.readouterr().err == ""
    with pytest.raises(OSError):
        run_command("bq", raising(OSError("disk")), debug=True)


def test_corrupted_checkpoint_is_reported(tmp_path):
    model = make_tiny("llama")
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
    save(model, tmp_path / "q")
    weights = tmp_path / "q" / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(UserError, match="missing or corrupted"):
        load_quantized(tmp_path / "q")


def test_real_model_rtn_round_trip(smollm, tmp_path):
    from bitquilt.models.loading import load_model

    model, tok = load_model("smollm2-135m")
    quantize(model, Recipe("rtn", w_bits=4, group_size=128), None, progress=False)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits
    save(model, tmp_path / "q4", tokenizer=tok)
    loaded, tok2 = bitquilt.load(tmp_path / "q4")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    assert tok2 is not None
    assert model_nbytes(loaded) < 0.45 * model_nbytes(smollm[0])  # embeddings stay fp32


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text", "phi3"])
def test_load_builds_no_full_precision_model(tmp_path, monkeypatch, model_type):
    """The skeleton holds no weight (parameters on the meta device), the saved tensors become the model's own, and
    the buffers no checkpoint holds (RoPE frequencies, Gemma's embedding scale) are computed as in a built model."""
    import bitquilt.io as bio
    from bitquilt.models.loading import empty_model

    def checked_skeleton(config, dtype):
        skeleton = empty_model(config, dtype)
        assert all(p.is_meta for p in skeleton.parameters())
        assert not any(b.is_meta for b in skeleton.buffers())
        return skeleton

    monkeypatch.setattr(bio, "empty_model", checked_skeleton)
    model = make_tiny(model_type)
    quantize(model, Recipe("rtn", w_bits=4, group_size=32), None, progress=False)
    loaded = reload_bit_exact(model, _ids(2), tmp_path / "q")
    tensors = dict(loaded.named_parameters(remove_duplicate=False)) | dict(loaded.named_buffers())
    assert not [name for name, t in tensors.items() if t.is_meta]
    assert dict(model.named_buffers()).keys() == dict(loaded.named_buffers()).keys()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, loaded.get_buffer(name)), name
    inv_freq = {n: b for n, b in loaded.model.rotary_emb.named_buffers() if n.endswith("inv_freq")}
    assert inv_freq and all(b.dtype == torch.float32 and b.abs().sum() > 0 for b in inv_freq.values())
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == model.config.tie_word_embeddings


def test_a_missing_full_precision_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_tiny("llama")
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
    save(model, tmp_path / "q")
    weights = tmp_path / "q" / WEIGHTS_NAME
    tensors = load_file(str(weights))
    del tensors["model.norm.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(UserError, match=r"does not match its config: missing \['model.norm.weight'\]"):
        load_quantized(tmp_path / "q")
    (tmp_path / "q" / WEIGHTS_NAME).unlink()
    with pytest.raises(UserError, match="missing or corrupted"):
        load_quantized(tmp_path / "q")


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A tiny RTN-quantized llama saved once; tests damage copies of it."""
    model = make_tiny("llama")
    quantize(model, Recipe("rtn", w_bits=4, group_size=64), None, progress=False)
    return save(model, tmp_path_factory.mktemp("saved") / "q")


def _edited_copy(saved, tmp_path, edit, name=CONFIG_NAME):
    """A copy of the saved directory `saved` whose JSON file `name` is replaced by `edit(its contents)`."""
    path = Path(shutil.copytree(saved, tmp_path / "q"))
    (path / name).write_text(json.dumps(edit(json.loads((path / name).read_text()))))
    return path


LAYER = "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize("edit, message", [
    (lambda q: [q], "the file must be an object of quantization settings, got a list"),
    (lambda q: {**q, "layers": None}, "'layers' must be an object of layer entries, got null"),
    (lambda q: {k: v for k, v in q.items() if k != "layers"},
     "'layers' must be an object of layer entries, got nothing"),
    (lambda q: {**q, "layers": {**q["layers"], LAYER: [4]}}, f"layer entry '{LAYER}' must be an object, got a list"),
    (lambda q: {**q, "layers": {LAYER: {"format": "uniform"}}},
     f"'meta' of layer '{LAYER}' must be an object, got nothing"),
    (lambda q: {**q, "online": [{"class": "KVQuantizer"}]},
     "'online' must be an object of online modules by host, got a list"),
    (lambda q: {**q, "online": {"model.layers.0.self_attn": {"kv_quant": {"class": "KVQuantizer"}}}},
     "online module model.layers.0.self_attn.kv_quant must be an object with a string 'class' and an object 'config', "
     "got an object"),
    (lambda q: {**q, "recipe": ["rtn"]}, "'recipe' must be an object or null, got a list"),
    (lambda q: {**q, "report": "fast"}, "'report' must be an object or null, got a string"),
])
def test_a_quantization_config_of_the_wrong_shape_is_one_line(saved_tiny, tmp_path, capsys, edit, message):
    from bitquilt.cli import main

    path = _edited_copy(saved_tiny, tmp_path, edit)
    expected = f"{path / CONFIG_NAME}: {message}; the file is damaged or was edited"
    with pytest.raises(UserError) as error:
        load_quantized(path)
    assert str(error.value) == expected
    assert main(["inspect", str(path)]) == 2
    assert capsys.readouterr().err == f"bitquilt inspect: error: {expected}\n"


def test_an_online_module_the_model_cannot_host_is_refused(saved_tiny, tmp_path):
    path = _edited_copy(saved_tiny, tmp_path, lambda q: {**q, "online": {
        "model.nowhere": {"kv_quant": {"class": "KVQuantizer", "config": {}}}}})
    with pytest.raises(UserError, match=r"q is corrupt or was edited: its online modules cannot be restored \(.*"
                                        r"no attribute `nowhere`\); quantize the model again$"):
        load_quantized(path)


def test_a_saved_config_json_with_a_wrong_typed_field_is_one_line(saved_tiny, tmp_path):
    path = _edited_copy(saved_tiny, tmp_path, lambda c: {**c, "num_hidden_layers": "two"}, name="config.json")
    with pytest.raises(UserError) as error:
        load_quantized(path)
    assert str(error.value) == (f"{path / 'config.json'} is not a valid model config: Validation error for field "
                                "'num_hidden_layers': TypeError: Field 'num_hidden_layers' expected int, got str "
                                "(value: 'two')")


def test_tensor_writer_writes_what_the_safetensors_library_reads(tmp_path):
    """`write_tensors` (saves write tensor by tensor): every dtype, empty and 0-d tensors, a non-contiguous one and
    metadata read back bit for bit by the library, each tensor aligned to its element size."""
    from safetensors import safe_open

    from bitquilt.tensor_header import read_header
    from bitquilt.tensor_writer import SAFETENSORS_DTYPES, write_tensors

    g = torch.Generator().manual_seed(0)
    tensors = {f"t_{str(d).split('.')[-1]}": (torch.randn(3, 5, generator=g) * 50).to(d) for d in SAFETENSORS_DTYPES}
    tensors |= {"empty": torch.empty(0, 4), "scalar": torch.tensor(7, dtype=torch.int16),
                "strided": torch.arange(24, dtype=torch.int32).reshape(4, 6).T, "odd": torch.ones(3, dtype=torch.uint8)}
    path = tmp_path / "t.safetensors"
    write_tensors(path, tensors, metadata={"format": "pt"})
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
    read_header(path, aligned=True)  # raises on a gap, an overlap or a misaligned tensor
    with pytest.raises(ValueError, match="complex64"):
        write_tensors(tmp_path / "c.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})
