"""Streaming quantization: block by block from the checkpoint on disk, bit-identical to quantizing in memory."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from bitquilt.api import open_streaming, quantize, quantize_streaming, save
from bitquilt.calib.stages import STAGES, register_stage
from bitquilt.cli import main
from bitquilt.errors import UserError
from bitquilt.io import WEIGHTS_NAME, load_quantized, quantization_record
from bitquilt.models.fused import fuse_parts
from bitquilt.models.loading import load_model
from bitquilt.models.streaming import fp_weights_held
from bitquilt.policies import mx_sens
from bitquilt.recipes import Recipe
from tests.conftest import make_tiny, save_tiny_with_tokenizer

RECIPES = {
    "rtn": dict(method="rtn", w_bits=4, group_size=32),
    "gptq": dict(method="gptq", w_bits=4, group_size=32),
    "awq+gptq-kv4": dict(method="awq+gptq", w_bits=3, group_size=32, kv_bits=4),
}


def _checkpoint(tmp_path, model_type: str = "llama", tied: bool = False):
    model = fuse_parts(make_tiny(model_type))  # the family's own checkpoint layout
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    path = tmp_path / f"fp-{model_type}{'-tied' if tied else ''}"
    model.save_pretrained(path)
    return path


def _calib(n: int = 4, seqlen: int = 64) -> torch.Tensor:
    return torch.randint(0, 320, (n, seqlen), generator=torch.Generator().manual_seed(0))


def _assert_same_saved(a, b) -> None:
    ta, tb = load_file(str(a / WEIGHTS_NAME)), load_file(str(b / WEIGHTS_NAME))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def _in_ram(path, recipe: Recipe, ids):
    model, _ = load_model(path)
    quantize(model, recipe, ids, progress=False)
    return model


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", False), ("llama", True)])
def test_streaming_is_bit_identical_to_in_memory(tmp_path, name, model_type, tied):
    path = _checkpoint(tmp_path, model_type, tied)
    recipe, ids = Recipe(**RECIPES[name]), _calib()
    ref = _in_ram(path, recipe, ids)
    model, _, report = quantize_streaming(path, recipe, ids, progress=False)
    assert len(report.linears) == len(ref.model.layers) * 7
    save(ref, tmp_path / "ram")
    save(model, tmp_path / "stream")
    _assert_same_saved(tmp_path / "ram", tmp_path / "stream")
    with torch.no_grad():
        assert torch.equal(ref(ids[:2]).logits, model(ids[:2]).logits)
        reloaded, _ = load_quantized(tmp_path / "stream")
        assert torch.equal(reloaded(ids[:2]).logits, model(ids[:2]).logits)


def test_only_one_block_holds_full_precision_weights(tmp_path):
    path = _checkpoint(tmp_path)
    stream = open_streaming(path)
    block = sum(m.weight.numel() for m in stream.layers[0].modules() if isinstance(m, torch.nn.Linear))
    held: list[tuple[int, int]] = []
    load = stream.load

    def spy(i):  # after block i is read: what it holds and what all blocks hold
        load(i)
        held.append((fp_weights_held(stream.layers[i]), fp_weights_held(stream.layers)))

    stream.load = spy
    assert fp_weights_held(stream.layers) == 0  # nothing of the blocks is read up front
    assert stream.model.lm_head.weight.is_meta and not stream.model.model.embed_tokens.weight.is_meta
    model, _, _ = quantize_streaming(stream, Recipe("gptq", w_bits=4, group_size=32), _calib(), progress=False)
    assert held == [(block, block)] * len(stream.layers)  # the block being quantized, nothing else
    assert stream.peak_fp_weights == block
    assert fp_weights_held(model.model.layers) == 0  # every block released: packed formats only
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with pytest.raises(UserError, match="already quantized"):
        quantize_streaming(stream, Recipe("rtn", w_bits=4, group_size=32))


@pytest.mark.parametrize("tied", [False, True])
def test_spilled_blocks_and_embedding_wait_mapped_and_leave_nothing_on_disk(tmp_path, monkeypatch, tied):
    """With a spill directory each finished block's packed linears, and the embedding table from the capture of the
    calibration inputs to `finish`, are views of a mapped file that is already unlinked; the result is bit-identical
    to the in-memory run and the embedding is back in memory of its own (stages may change it in place)."""
    from bitquilt.mapped import _mapping_of
    from bitquilt.models import streaming

    monkeypatch.setattr(streaming, "READ_CHUNK_BYTES", 1000)  # the embedding comes back a few rows at a time
    path = _checkpoint(tmp_path, "llama", tied)
    recipe, ids = Recipe("gptq", w_bits=4, group_size=32), _calib()
    ref = _in_ram(path, recipe, ids)
    spill = tmp_path / "spill"
    spill.mkdir()
    stream = open_streaming(path, spill_dir=spill)
    embed = lambda: stream.model.model.embed_tokens.weight  # noqa: E731
    seen, load = [], stream.load

    def spy(i):  # as block i is read: the embedding and every finished block are mapped, nothing is on disk
        load(i)
        packed = [t for layer in stream.layers[:i] for t in layer.buffers()]
        seen.append(_mapping_of(embed()) is not None and all(_mapping_of(t) is not None for t in packed)
                    and not any(spill.iterdir()))

    stream.load = spy
    model, _, _ = quantize_streaming(stream, recipe, ids, progress=False)
    assert seen == [True] * len(stream.layers) and not any(spill.iterdir())
    assert _mapping_of(embed()) is None and torch.equal(embed(), ref.model.embed_tokens.weight)
    assert (model.lm_head.weight.data_ptr() == embed().data_ptr()) == tied
    save(ref, tmp_path / "ram")
    save(model, tmp_path / "stream")
    _assert_same_saved(tmp_path / "ram", tmp_path / "stream")
    with torch.no_grad():
        assert torch.equal(ref(ids[:2]).logits, model(ids[:2]).logits)


def test_a_tensor_converted_while_read_equals_the_stored_one_converted(tmp_path, monkeypatch):
    """`TensorFiles.read(name, dtype)` converts through a bounded buffer; chunks that do not divide the tensor (and
    the embedding read back from its spill in row chunks, in the test above) give the same values."""
    from safetensors.torch import save_file

    from bitquilt.models import streaming

    t = torch.randn(37, 11, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    save_file({"t": t, "i": torch.arange(5)}, str(tmp_path / "w.safetensors"))
    monkeypatch.setattr(streaming, "READ_CHUNK_BYTES", 50)  # 25 bf16 values a chunk
    files = streaming.TensorFiles(tmp_path)
    got = files.read("t", torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, t.float()) and torch.equal(files.read("t"), t)
    assert torch.equal(files.read("i"), torch.arange(5))


def test_a_spill_directory_must_exist(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        open_streaming(_checkpoint(tmp_path), spill_dir=tmp_path / "missing")


def test_streams_a_sharded_bf16_checkpoint_reporting_each_block(tmp_path):
    """Hugging Face's sharded layout (model-0000X-of-0000N.safetensors + index) in bf16, as large models ship: read
    across the shards, widened to fp32 as the in-memory load does, with `on_block` called as each block ends."""
    path = tmp_path / "fp-sharded-bf16"
    make_tiny().to(torch.bfloat16).save_pretrained(path, max_shard_size="200KB")
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    recipe, ids, seen = Recipe(**RECIPES["gptq"]), _calib(), []
    model, _, report = quantize_streaming(path, recipe, ids, progress=False,
                                          on_block=lambda i, r: seen.append((i, len(r.block_cpu_seconds))))
    assert seen == [(0, 1), (1, 2)] and len(report.block_seconds) == 2
    save(_in_ram(path, recipe, ids), tmp_path / "ram")
    save(model, tmp_path / "stream")
    _assert_same_saved(tmp_path / "ram", tmp_path / "stream")


@pytest.mark.parametrize("fields", [
    dict(method="bpdq", w_bits=2, group_size=32),
    dict(method="mxint", w_bits=4, a_bits=4, kv_bits=4),
    dict(method="smoothquant+rtn", w_bits=4, group_size=32, a_bits=8),
    dict(method="awq+rtn", w_bits=3, group_size=32, recon_steps=2),
], ids=lambda f: f["method"])
def test_every_block_method_streams(tmp_path, fields):
    path, recipe, ids = _checkpoint(tmp_path), Recipe(**fields), _calib(2, 32)
    ref = _in_ram(path, recipe, ids)
    model, _, _ = quantize_streaming(path, recipe, ids, progress=False)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "phi3"])  # phi3: parts read from fused tensors
def test_every_architecture_streams(tmp_path, model_type):
    path, recipe, ids = _checkpoint(tmp_path, model_type), Recipe("gptq", w_bits=4, group_size=32), _calib(2, 32)
    ref = _in_ram(path, recipe, ids)
    model, _, _ = quantize_streaming(path, recipe, ids, progress=False)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, model(ids).logits)


# Whole-model stages under streaming. Every one is bit-identical to the in-memory run: QuaRot performs the same
# float64 operations on each tensor whether it meets the block at once or as the block is read, and the pre-passes
# run the same block forwards on the same inputs (MXSens here with one linear per pass, its most passes).
WHOLE_MODEL = {
    "quarot+rtn-w4a4kv4": dict(method="quarot+rtn", group_size=32, a_bits=4, kv_bits=4),
    "quarot+gptq-w4a4kv4": dict(method="quarot+gptq", group_size=32, a_bits=4, kv_bits=4),
    "quarot+rtn-w4": dict(method="quarot+rtn", group_size=32),
    "quarot+gptq-w4": dict(method="quarot+gptq", group_size=32),
    "mxsens": dict(method="mxsens", stage_options={"mx_sens": {"target_bits": 5.2}}),
    "dynamic_a8": dict(method="quarot+rtn", group_size=32, a_bits=4, kv_bits=4, a8_layers=1),
}


def _streamed_like_in_memory(tmp_path, monkeypatch, path, fields, stream_fields=None):
    """Quantize `path` in memory and streamed (each with an MXSens memo of its own: both measure), check the saved
    weights, the decisions and the logits are identical; the streaming checkpoint."""
    ids = _calib(4, 32)
    monkeypatch.setattr(mx_sens, "memo_file", lambda key: tmp_path / "ram" / f"{key}.json")
    ref = _in_ram(path, Recipe(**fields), ids)
    monkeypatch.setattr(mx_sens, "memo_file", lambda key: tmp_path / "stream" / f"{key}.json")
    stream = open_streaming(path)
    model, _, report = quantize_streaming(stream, Recipe(**(stream_fields or fields)), ids, progress=False)
    save(ref, tmp_path / "ram-q")
    save(model, tmp_path / "stream-q")
    _assert_same_saved(tmp_path / "ram-q", tmp_path / "stream-q")
    assert report.plan["decisions"] == quantization_record(ref)["report"]["plan"]["decisions"]
    with torch.no_grad():
        assert torch.equal(ref(ids[:2]).logits, model(ids[:2]).logits)
    return stream


@pytest.mark.parametrize("name", list(WHOLE_MODEL))
def test_whole_model_stages_stream_bit_identically(tmp_path, monkeypatch, name):
    path = _checkpoint(tmp_path, "llama", tied=True)  # QuaRot unties the head: streamed, it is read from the embedding
    fields = streamed = WHOLE_MODEL[name]
    if name == "mxsens":  # one linear per sensitivity pass: the most passes over the blocks, the same result
        streamed = {**fields, "stage_options": {"mx_sens": {"target_bits": 5.2, "stream_mb": 1e-6}}}
    block = sum(m.weight.numel() for m in open_streaming(path).layers[0].modules() if isinstance(m, torch.nn.Linear))
    stream = _streamed_like_in_memory(tmp_path, monkeypatch, path, fields, streamed)
    assert stream.peak_fp_weights == block  # the pre-passes too held one block at a time


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])  # biases; q/k norms
def test_quarot_streams_bit_identically_on_every_architecture(tmp_path, monkeypatch, model_type):
    _streamed_like_in_memory(tmp_path, monkeypatch, _checkpoint(tmp_path, model_type),
                             WHOLE_MODEL["quarot+gptq-w4a4kv4"])


@pytest.fixture
def whole_model_stage():
    """A model-scope stage that reads the whole model and does not declare it streams."""
    register_stage("toy_whole", scope="model", kind="transform", needs_calibration=False)(lambda ctx, _o: None)
    yield
    STAGES.unregister("toy_whole")


def test_a_stage_that_cannot_stream_is_refused_by_name(tmp_path, capsys, whole_model_stage):
    with pytest.raises(UserError, match=r"toy_whole \(model\) read the whole model") as e:
        quantize_streaming(tmp_path / "never-opened", Recipe("toy_whole+rtn"), _calib())
    assert "\n" not in str(e.value)
    code = main(["quantize", str(_checkpoint(tmp_path)), "--method", "toy_whole+rtn", "--stream",
                 "-o", str(tmp_path / "q")])
    err = capsys.readouterr().err
    assert code == 2 and "toy_whole (model)" in err and "without --stream" in err
    assert not (tmp_path / "q").exists()


def test_refuses_what_is_not_a_full_precision_hf_folder(tmp_path):
    path = _checkpoint(tmp_path)
    model, _ = load_model(path)
    quantize(model, Recipe("rtn", w_bits=4, group_size=32), progress=False)
    save(model, tmp_path / "q")
    with pytest.raises(UserError, match="already quantized"):
        open_streaming(tmp_path / "q")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(UserError, match="is a .gguf file"):
        open_streaming(tmp_path / "m.gguf")
    (path / WEIGHTS_NAME).write_bytes((path / WEIGHTS_NAME).read_bytes()[:-1000])
    with pytest.raises(UserError, match="truncated"):
        open_streaming(path)


def test_nan_weights_are_refused_when_their_block_is_read(tmp_path):
    path = _checkpoint(tmp_path)
    model, _ = load_model(path)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(path)
    with pytest.raises(UserError, match=r"layers\.1\.mlp\.up_proj\.weight contains NaN"):
        quantize_streaming(path, Recipe("rtn", w_bits=4, group_size=32), progress=False)


def test_cli_stream_matches_the_in_memory_cli(tmp_path, capsys):
    path = _checkpoint(tmp_path, "qwen2")
    args = ["quantize", str(path), "--method", "rtn", "--w-bits", "4", "--group-size", "32", "--json"]
    assert main(args + ["-o", str(tmp_path / "ram")]) == 0
    assert main(args + ["--stream", "-o", str(tmp_path / "stream")]) == 0
    _assert_same_saved(tmp_path / "ram", tmp_path / "stream")
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / "ram" / name).read_text() == (tmp_path / "stream" / name).read_text()


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A tiny qwen2 with the default model's tokenizer (the CLI builds calibration windows with it) and a text file
    to calibrate on: (checkpoint, text)."""
    root = tmp_path_factory.mktemp("tokenized")
    save_tiny_with_tokenizer(root / "fp", "qwen2")
    (root / "text.txt").write_text(" ".join(f"Sentence {i} says the river flows past the mill." for i in range(60)))
    return root / "fp", root / "text.txt"


@pytest.mark.parametrize("args,prepass", [
    (["--method", "quarot+gptq", "--a-bits", "4", "--kv-bits", "4"], None),
    (["--method", "mxsens", "--target-bits", "5.2"], "mx_sens reference"),
    (["--method", "quarot+rtn", "--a-bits", "4", "--a8-layers", "1"], "dynamic_a8 pre-pass"),
], ids=["quarot+gptq", "mxsens", "dynamic_a8"])
def test_cli_streams_whole_model_methods(tmp_path, capsys, monkeypatch, with_tokenizer, args, prepass):
    monkeypatch.setattr(mx_sens, "memo_file", lambda key: tmp_path / f"{key}.json")
    (path, text), out = with_tokenizer, tmp_path / "q"
    code = main(["quantize", str(path), *args, "--group-size", "32", "--calib-data", str(text), "--calib-samples",
                 "4", "--calib-seqlen", "32", "--stream", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert prepass is None or prepass in err  # the pre-pass shows its progress
    model, _ = load_quantized(out)
    with torch.no_grad():
        assert torch.isfinite(model(_calib(1, 16)).logits).all()
