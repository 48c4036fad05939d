"""The standalone runtime (bitquilt.runtime.standalone) and its export (bitquilt.export.standalone): the torch runtime's
fused int8 layers, bit for bit, from a mapped file, in a process that never imports torch."""

import json
import math
import subprocess
import sys
from array import array

import numpy as np
import pytest
import torch
from conftest import WINDOWED, make_tiny

from bitquilt.api import export, quantize, save
from bitquilt.errors import UserError
from bitquilt.io import load_quantized
from bitquilt.kernels import q4_int8
from bitquilt.nn.slice_router import precision_range, set_precision
from bitquilt.recipes import Recipe
from bitquilt.runtime.lean import LeanDecoder
from bitquilt.runtime.standalone.file import MappedTensors
from bitquilt.runtime.standalone.generate import generate, generate_ids, picker
from bitquilt.runtime.standalone.model import FILE, StandaloneModel, set_isa, set_threads


def _saved(tmp_path, model_type: str, recipe: Recipe):
    model = make_tiny(model_type, **WINDOWED.get(model_type, {}))
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(2))
    quantize(model, recipe, ids)
    save(model, tmp_path / "saved")
    return tmp_path / "saved"


@pytest.fixture
def widest_path():
    """Both runtimes back on their default kernel path after the test."""
    yield
    q4_int8.set_isa()
    set_isa()


def _reference(saved, monkeypatch, standalone: StandaloneModel, avg_bits: float | None = None) -> LeanDecoder:
    """The bitquilt runtime's fused int8 decoder for `saved` (a routed model's at `avg_bits`, if given), its RoPE tables
    those of `standalone` (begun); the caller runs where int8 activations are allowed (`int8_on`)."""
    model, _ = load_quantized(saved, runtime="bitquilt")
    if avg_bits is not None:
        set_precision(model, avg_bits)
    def tables(name: str) -> tuple[torch.Tensor, torch.Tensor]:  # the C tables: fp32 angles, cos and sin in double
        angles = torch.arange(standalone.max_len, dtype=torch.float32)[:, None] * \
            torch.tensor(np.asarray(standalone.tensors[name].values()))[None]
        angles = torch.cat([angles, angles], 1).double()
        return angles.cos().float()[None], angles.sin().float()[None]

    cos, sin = (torch.tensor(np.asarray(t))[None] for t in standalone.rope())
    by_type = {None: tables("rope.inv_freq"), "full_attention": tables("rope.inv_freq")}
    assert torch.equal(cos, by_type[None][0]) and torch.equal(sin, by_type[None][1])
    if "rope.sliding_attention.inv_freq" in standalone.tensors:  # gemma3's sliding layers
        by_type["sliding_attention"] = tables("rope.sliding_attention.inv_freq")
    monkeypatch.setattr(model.model.rotary_emb, "forward", lambda x, positions, layer_type=None: by_type[layer_type])
    decoder = LeanDecoder(model, standalone.max_len)
    assert decoder.fused is not None, decoder.fused_reason
    return decoder


@pytest.mark.parametrize("isa", ["avx2", "avxvnni", "widest"])  # the baseline, AVX-VNNI where present, the widest
@pytest.mark.parametrize("model_type, recipe, kinds", [
    ("llama", Recipe("rtn", w_bits=4, group_size=64, head_bits=8), {"q4", "u8"}),
    ("qwen2", Recipe("rtn", w_bits=4, group_size=64), {"q4", "dense"}),
    ("qwen3", Recipe("rtn", w_bits=2, group_size=64, head_bits=4), {"q4"}),
    ("gemma3_text", Recipe("rtn", w_bits=4, group_size=64, head_bits=8), {"q4", "u8"}),
    ("gemma2", Recipe("rtn", w_bits=4, group_size=64), {"q4", "dense"}),
    ("mixtral", Recipe("rtn", w_bits=4, group_size=64), {"q4", "dense"}),
    ("olmoe", Recipe("rtn", w_bits=4, group_size=64, head_bits=8), {"q4", "u8"}),
], ids=["llama-w4-head8", "qwen2-w4-biases", "qwen3-w2-head4-qknorms", "gemma3-w4-head8", "gemma2-w4-capped",
        "mixtral-w4-experts", "olmoe-w4-head8-whole-qknorms"])
def test_standalone_runs_the_fused_int8_runtimes_layers_bit_for_bit(tmp_path, monkeypatch, widest_path, int8_on,
                                                                    model_type, recipe, kinds, isa):
    if isa not in ("widest", *q4_int8.supported_isas()):
        pytest.skip(f"this CPU has no {isa} path")
    saved = _saved(tmp_path, model_type, recipe)
    summary = export(saved, tmp_path / "out", to="standalone")
    assert set(summary.kinds) == kinds and summary.file_bytes == (tmp_path / "out" / FILE).stat().st_size
    model = StandaloneModel(tmp_path / "out")
    path = set_isa(None if isa == "widest" else isa)
    assert q4_int8.set_isa(path) == path  # both runtimes on the same kernel path (`widest_path` restores it)
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    model.begin(16)
    reference = _reference(saved, monkeypatch, model)
    for token in ids:  # one token at a time: the same kernels and layer math in the same order, so the same caches
        expected = reference.forward(torch.tensor([[token]])).numpy()
        got = model.forward([token])  # the final norm runs in another order: the head's input differs by ulps
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    caches = [model.cache(i) for i in range(len(reference.cache.keys))]
    for (keys, values), ref_keys, ref_values in zip(caches, reference.cache.keys, reference.cache.values, strict=True):
        assert np.array_equal(keys, ref_keys[0].numpy()) and np.array_equal(values, ref_values[0].numpy())
    model.begin(16)  # the prompt in one batched pass: the same logits
    np.testing.assert_array_equal(model.forward(ids), got)
    greedy = generate_ids(model, ids[:4], 6)
    reference.reset()
    tokens = [int(reference.forward(torch.tensor([ids[:4]])).argmax())]
    while len(tokens) < 6:
        tokens.append(int(reference.forward(torch.tensor([[tokens[-1]]])).argmax()))
    assert greedy.new_ids == tokens


# 2 query heads per KV head; qwen3: q/k norms too; gemma3: windows of 5 across the prompt's blocks
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "gemma3_text", "qwen3_moe"])
def test_a_long_prompt_in_blocks_gives_the_token_by_token_results(tmp_path, monkeypatch, int8_on, model_type):
    """A 500-token prompt crosses the runner's prompt passes (256 tokens) and many attention blocks (16 queries):
    in one call, or in two at a position that is no block boundary, it leaves the caches and logits of the torch
    runtime's fused decode step run one token at a time."""
    saved = _saved(tmp_path, model_type, Recipe("rtn", w_bits=4, group_size=64))
    export(saved, tmp_path / "out", to="standalone")
    model = StandaloneModel(tmp_path / "out")
    ids = torch.randint(0, 320, (500,), generator=torch.Generator().manual_seed(7)).tolist()
    model.begin(512)
    whole = model.forward(ids)
    reference = _reference(saved, monkeypatch, model)
    for token in ids:
        expected = reference.forward(torch.tensor([[token]])).numpy()
    np.testing.assert_allclose(whole, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    for layer, (keys, values) in enumerate(zip(reference.cache.keys, reference.cache.values, strict=True)):
        got_keys, got_values = (np.asarray(c)[:, :500] for c in model.cache(layer))
        assert np.array_equal(got_keys, keys[0, :, :500].numpy())  # every position's attention, bit for bit
        assert np.array_equal(got_values, values[0, :, :500].numpy())
    model.begin(512)
    model.forward(ids[:301])
    np.testing.assert_array_equal(model.forward(ids[301:]), whole)


def _routed_settings(routed_tiny) -> tuple[float, float, float, float]:
    """(low, high) of the routed model's range, and two average bits well inside it."""
    low, high = precision_range(load_quantized(routed_tiny / "saved", runtime="bitquilt")[0])
    return low, high, low + 0.2 * (high - low), high - 0.2 * (high - low)


def test_a_routed_export_runs_the_fused_runtimes_routed_layers(routed_tiny, monkeypatch, int8_on):
    """MoBiQuant slices and routers: the standalone runtime runs the fused torch runtime's bit-plane x int8 kernel
    (its int8 activations, as for every low-bit linear there) and routing code, so, token by token, the same logits
    (but for the final norm's order) and greedy tokens at the same avg_bits (the checkpoint's saved thresholds by
    default), and fewer bits used at a lower avg_bits."""
    low, high, lower, higher = _routed_settings(routed_tiny)
    model = StandaloneModel(routed_tiny / "out")
    assert model.config["format_version"] == 4
    assert {e["kind"] for e in model.config["linears"].values()} == {"slices", "dense"}
    used = {}
    for avg_bits in (None, lower, higher):
        model.set_avg_bits(avg_bits)
        model.begin(24)
        reference = _reference(routed_tiny / "saved", monkeypatch, model, avg_bits)
        token, tokens, expected_tokens = 17, [], []
        for _ in range(16):  # greedy, one token at a time in both (the prompt is the first token)
            expected = reference.forward(torch.tensor([[token]])).numpy()
            got = np.asarray(model.forward([token]))
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
            token = int(got.argmax())
            tokens.append(token)
            expected_tokens.append(int(expected.argmax()))
        assert tokens == expected_tokens
        used[avg_bits] = model.routed_bits()
        assert low - 1e-6 <= used[avg_bits] <= high + 1e-6
    assert used[lower] < used[higher]
    with pytest.raises(UserError, match=r"average bits 99 are out of this checkpoint's routed range \["):
        model.set_avg_bits(99)


def test_the_runners_route_to_avg_bits_and_refuse_what_the_model_cannot(routed_tiny, tmp_path):
    """bitquilt-run and bitquilt-native --avg-bits: the same text and bits used; out of range, or on a model without
    routers, one line and exit 2; `bitquilt generate --avg-bits` on the saved model too."""
    from bitquilt.cli import main

    low, high, lower, higher = _routed_settings(routed_tiny)
    out, runner = str(routed_tiny / "out"), _native("--path").stdout.strip()
    common = ["--prompt", "The capital of France is", "--max-new-tokens", "8", "--threads", "1", "--ignore-eos",
              "--json"]
    used = {}
    for avg_bits in (lower, higher):
        native = _run_json([runner, out, *common, "--avg-bits", repr(avg_bits)])
        python = _run_json([sys.executable, "-m", "bitquilt.runtime.standalone.cli", out, *common, "--avg-bits",
                            repr(avg_bits)])
        assert native["completion"] == python["completion"] and native["avg_bits"] == python["avg_bits"]
        assert low - 1e-6 <= native["avg_bits"] <= high + 1e-6
        used[avg_bits] = native["avg_bits"]
    assert used[lower] < used[higher]
    assert _run_json([runner, out, *common])["avg_bits"] is not None  # the saved thresholds
    plain = _saved(tmp_path, "llama", Recipe("rtn", w_bits=4, group_size=64))
    export(plain, tmp_path / "plain", to="standalone")
    for model, value, message in [(out, "99", "out of this checkpoint's routed range ["),
                                  (out, "x", "invalid float value: 'x'"),
                                  (str(tmp_path / "plain"), "3", "the model has no slice routers")]:
        done = _native(model, "--prompt", "x", "--avg-bits", value)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
        if value != "x":  # (argparse's own usage line for a value that is no number)
            done = subprocess.run([sys.executable, "-m", "bitquilt.runtime.standalone.cli", model, "--prompt", "x",
                                   "--avg-bits", value], capture_output=True, text=True)
            assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    saved = str(routed_tiny / "saved")
    assert main(["generate", saved, "--prompt", "Hi", "--max-new-tokens", "2", "--avg-bits", repr(lower)]) == 0
    assert main(["generate", saved, "--prompt", "Hi", "--avg-bits", "99"]) == 2
    assert main(["generate", str(plain), "--prompt", "Hi", "--avg-bits", "3"]) == 2


def test_standalone_sampling_follows_the_softmax():
    logits = array("f", [0.0, 1.0, 2.0, -1.0])
    assert picker()(logits) == 2
    draws = [picker(0.7, seed)(logits) for seed in range(4000)]
    p = np.exp(np.array(logits) / 0.7)
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), p / p.sum(), atol=0.025)
    first, again, other = picker(1.0, 3), picker(1.0, 3), picker(1.0, 4)
    sequence = [first(logits) for _ in range(50)]
    assert sequence == [again(logits) for _ in range(50)] != [other(logits) for _ in range(50)]  # seeded
    probs = array("f", [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)])  # top_p: the fewest likely that reach it
    assert {picker(1.0, seed, top_p=0.6)(probs) for seed in range(200)} == {0, 1}
    assert {picker(1.0, seed, top_p=0.5)(probs) for seed in range(50)} == {0}
    assert len({picker(1.0, seed)(probs) for seed in range(400)}) == 4


def test_standalone_export_refuses_what_the_runtime_cannot_run(tmp_path):
    saved = _saved(tmp_path, "llama", Recipe("rtn", w_bits=3, group_size=64))
    with pytest.raises(UserError, match=r"cannot export model\.layers\.0\.self_attn\.q_proj .*3-bit codes"):
        export(saved, tmp_path / "out", to="standalone")
    saved = _saved(tmp_path / "g32", "llama", Recipe("rtn", w_bits=4, group_size=32))
    with pytest.raises(UserError, match="groups of 32 .multiples of 64 needed"):
        export(saved, tmp_path / "out", to="standalone")
    sliced = _saved(tmp_path / "sliced", "llama", Recipe("mobislice", w_bits=4, group_size=32,
                                                         options={"slices": (2, 1, 1)}))
    with pytest.raises(UserError, match=r"q_proj .*sliced weights without a router \(a mobislice checkpoint\)"):
        export(sliced, tmp_path / "out", to="standalone")
    with pytest.raises(UserError, match="applies to GGUF exports"):
        export(saved, tmp_path / "out", to="standalone", tokenizer_from="x.gguf")
    with pytest.raises(UserError, match="not a directory saved by bitquilt"):
        export(tmp_path, tmp_path / "out", to="standalone")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_standalone_bad_input(tmp_path):
    saved = _saved(tmp_path, "llama", Recipe("rtn", w_bits=4, group_size=64))
    export(saved, tmp_path / "out", to="standalone")
    with pytest.raises(UserError, match="is not a standalone export"):
        StandaloneModel(saved)
    model = StandaloneModel(tmp_path / "out")
    with pytest.raises(UserError, match="call begin"):
        model.forward([1])
    with pytest.raises(UserError, match="does not fit the model's 512"):
        model.begin(513)
    with pytest.raises(UserError, match="18446744073709551617 positions does not fit"):  # not wrapped to 1
        model.begin(2**64 + 1)
    with pytest.raises(UserError, match="threads must be between 1 and 1024, got 4294967296"):
        set_threads(2**32)
    model.begin(4)
    with pytest.raises(UserError, match="token id 320 outside the vocabulary of 320"):
        model.forward([320])
    with pytest.raises(UserError, match="outside the cache's 4"):
        model.forward([1, 2, 3, 4, 5])
    with pytest.raises(UserError, match="no tokenizer files"):
        generate(model, "hi")
    with pytest.raises(UserError, match="the prompt must be text .str., got list"):
        generate(model, [1, 2, 3])
    model.begin(4)
    with pytest.raises(UserError, match="forward needs at least one token id"):
        model.forward([])
    with pytest.raises(UserError, match="token ids must be a sequence of integers, got 5"):
        model.forward(5)
    data = (tmp_path / "out" / FILE).read_bytes()
    (tmp_path / "out" / FILE).write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(UserError, match="truncated or corrupt"):
        StandaloneModel(tmp_path / "out").begin(4)
    (tmp_path / "out" / FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a readable safetensors file"):
        MappedTensors(tmp_path / "out" / FILE)
    (tmp_path / "out" / FILE).write_bytes(b"")
    with pytest.raises(UserError, match="0 bytes long, shorter than a safetensors header"):
        MappedTensors(tmp_path / "out" / FILE)


def _edit_header(path, edit) -> None:
    """The safetensors file at `path` with `edit(header)` applied, its header padded to the same length."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    data[8:8 + length] = text.ljust(length)
    path.write_bytes(bytes(data))


def test_a_damaged_standalone_header_is_one_clear_error(tmp_path):
    saved = _saved(tmp_path, "llama", Recipe("rtn", w_bits=4, group_size=64))
    export(saved, tmp_path / "out", to="standalone")
    path = tmp_path / "out" / FILE
    original = path.read_bytes()

    def drop_vocab_size(header):
        meta = json.loads(header["__metadata__"]["bitquilt.runtime.standalone"])
        del meta["vocab_size"]
        header["__metadata__"]["bitquilt.runtime.standalone"] = json.dumps(meta)

    _edit_header(path, drop_vocab_size)
    with pytest.raises(UserError, match="standalone metadata lacks vocab_size: the file is damaged"):
        StandaloneModel(tmp_path / "out")
    path.write_bytes(original)
    name = "model.norm.weight"
    _edit_header(path, lambda header: header[name].pop("dtype"))
    with pytest.raises(UserError, match=f"tensor '{name}' has no dtype"):
        MappedTensors(path)[name]
    with pytest.raises(UserError, match=f"tensor '{name}' has no dtype"):  # the C library's own reader
        StandaloneModel(tmp_path / "out").begin(4)


RUN = """
import json, sys
from bitquilt.runtime.standalone.cli import main
code = main([sys.argv[1], "--prompt", "The capital of France is", "--max-new-tokens", "8", "--threads", "1", "--json"])
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules}))
"""


def test_bitquilt_run_generates_text_without_importing_torch_or_numpy(exported_smollm, capsys):
    from bitquilt.cli import main

    done = subprocess.run([sys.executable, "-c", RUN, str(exported_smollm / "out")], capture_output=True, text=True,
                          check=True)
    lines = done.stdout.strip().splitlines()
    result, status = json.loads("\n".join(lines[:-1])), json.loads(lines[-1])
    assert status == {"code": 0, "torch": False, "numpy": False}
    assert "Paris" in result["completion"] and result["new_tokens"] == 8 and result["peak_rss_mb"] > 0
    assert result["decode_tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0
    done = subprocess.run([sys.executable, "-m", "bitquilt.runtime.standalone.cli", str(exported_smollm / "out"),
                           "--prompt", "The capital of France is", "--max-new-tokens", "8", "--threads", "1"],
                          capture_output=True, text=True, check=True)  # streamed: the same text, figures on stderr
    assert done.stdout == "The capital of France is" + result["completion"] + "\n"
    assert "decode_tokens_per_s" in done.stderr
    done = subprocess.run([sys.executable, "-m", "bitquilt.runtime.standalone.cli", str(exported_smollm / "saved"),
                           "--prompt", "hi"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is not a standalone export" in done.stderr
    capsys.readouterr()
    assert main(["generate", str(exported_smollm / "out"), "--prompt", "The capital of France is", "--max-new-tokens",
                 "8", "--threads", "1", "--json"]) == 0  # `bitquilt generate` runs a standalone export as bitquilt-run
    assert json.loads(capsys.readouterr().out)["completion"] == result["completion"]
    assert main(["generate", str(exported_smollm / "out"), "--prompt", "hi", "--runtime", "bitquilt"]) == 2
    assert "runs in the standalone runtime only" in capsys.readouterr().err
    assert main(["export", str(exported_smollm / "saved"), "-o", str(exported_smollm / "out"), "--to",
                 "standalone"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_bitquilt_bench_measures_a_standalone_export_beside_its_saved_model(exported_smollm, capsys):
    from bitquilt.cli import main

    saved, out = str(exported_smollm / "saved"), str(exported_smollm / "out")
    assert main(["bench", saved, out, "--prompt-tokens", "16", "--new-tokens", "4", "--repeats", "1", "--threads",
                 "1", "--int8-activations", "--json"]) == 0
    torch_row, standalone_row = json.loads(capsys.readouterr().out)
    assert set(standalone_row) == set(torch_row) | {"decode_speedup", "prefill_speedup"}  # the same fields, and
    assert standalone_row["decode_speedup"] > 0  # the speedup against the first (saved) model
    assert standalone_row["decode_tokens_per_s"] > 0 and standalone_row["prefill_tokens_per_s"] > 0
    assert standalone_row["threads"] == 1 and standalone_row["kernel_layout_mb"] == 0
    assert standalone_row["bits_per_weight"] == pytest.approx(torch_row["bits_per_weight"], rel=0.03)  # + fp32 s, s·z
    assert standalone_row["weights_mb"] == pytest.approx(torch_row["weights_mb"], rel=0.03)
    assert main(["bench", out, "--engine", "lean"]) == 2
    assert "runs in the standalone runtime only" in capsys.readouterr().err


def _native(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bitquilt.runtime.standalone.program", *args], capture_output=True,
                          text=True)


def _run_json(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_bitquilt_native_runs_the_export_without_python_as_bitquilt_run_does(exported_smollm):
    out = str(exported_smollm / "out")
    runner = _native("--path").stdout.strip()
    common = ["--prompt", "The capital of France is", "--max-new-tokens", "12", "--threads", "1", "--json"]
    completions = []
    for extra in ([], ["--temperature", "0.9", "--seed", "7"]):  # greedy, and the same draws as Python's generator
        native = _run_json([runner, out, *common, *extra])
        python = _run_json([sys.executable, "-m", "bitquilt.runtime.standalone.cli", out, *common, *extra])
        assert native["completion"] == python["completion"] and native["new_tokens"] == python["new_tokens"]
        assert native["prompt_tokens"] == python["prompt_tokens"] == 5
        kernels = python["engine"].removeprefix("standalone ")  # "(avx512 kernels)": the path both ran
        assert native["runtime"] == python["runtime"] == "standalone"
        assert native["engine"] == f"bitquilt-native {kernels}"
        assert native["decode_tokens_per_s"] > 0 and native["prefill_tokens_per_s"] > 0
        completions.append(native["completion"])
        file_mb = (exported_smollm / "out" / FILE).stat().st_size / 2**20
        assert native["peak_rss_mb"] < file_mb + 30 < python["peak_rss_mb"] + 30  # the weights' pages, little else
    greedy, sampled = completions
    assert "Paris" in greedy and sampled != greedy
    streamed = _native(out, *common[:-1])  # through the wrapper: exec'd in place, text streamed, figures on stderr
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == "The capital of France is" + greedy + "\n"
    assert "decode_tokens_per_s=" in streamed.stderr and "peak_rss_mb=" in streamed.stderr
    assert streamed.stderr.startswith("runtime=standalone, engine=bitquilt-native (")
    special = _run_json([runner, out, "--prompt", "<|im_start|>user\nHi<|im_end|>", "--max-new-tokens", "2",
                         "--ignore-eos", "--json"])
    assert special["prompt_tokens"] == len(StandaloneModel(out).tokenizer.encode("<|im_start|>user\nHi<|im_end|>"))


@pytest.mark.parametrize("command", ["bitquilt-run", "bitquilt-native"])
def test_a_closed_or_full_output_ends_the_runtimes_quietly_or_with_one_line(exported_smollm, command):
    """`| head` stops them as it stops cat (SIGPIPE, no traceback); a full disk is one line and exit 1."""
    module = {"bitquilt-run": "bitquilt.runtime.standalone.cli",
              "bitquilt-native": "bitquilt.runtime.standalone.program"}[command]
    args = [sys.executable, "-m", module, str(exported_smollm / "out"), "--prompt", "Once upon a time", "--threads",
            "1", "--ignore-eos", "--max-new-tokens"]
    with subprocess.Popen([*args, "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as reader:
        assert reader.stdout.read(4) == b"Once"
        reader.stdout.close()  # the reader goes away mid-generation
        assert reader.wait(timeout=120) in (-13, 141) and reader.stderr.read() == b""  # SIGPIPE, or 141 (Python)
    with open("/dev/full", "w") as full:
        done = subprocess.run([*args, "4"], stdout=full, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "No space left on device" in done.stderr


def test_bitquilt_run_refuses_bad_flags_in_one_line(exported_smollm):
    out = str(exported_smollm / "out")
    for args, message in [(["--prompt", "ab\udcffcd"], "--prompt is not UTF-8 text"),
                          (["--prompt", "x", "--threads", "2147483648"], "--threads must be ≤ 1024, got 2147483648"),
                          (["--prompt", "x", "--temperature", "nan"], "--temperature must be a finite number"),
                          (["--prompt", "x", "--temperature", "-1"], "--temperature must be ≥ 0"),
                          (["--prompt", "x", "--max-new-tokens", "18446744073709551616"],
                           "--max-new-tokens must be ≤ 2147483647")]:
        done = subprocess.run([sys.executable, "-m", "bitquilt.runtime.standalone.cli", out, *args],
                              capture_output=True, text=True, errors="surrogateescape")
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, (args, done.stderr)


def test_bitquilt_native_bad_input(exported_smollm, tmp_path):
    out = str(exported_smollm / "out")
    cases = [([out], "the following arguments are required"), ([out, "--prompt", ""], "--prompt is empty"),
             ([out, "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be ≥ 1, got 0"),
             ([out, "--prompt", "x", "--max-new-tokens", "9223372036854775807"], "must be ≤ 2147483647"),
             ([out, "--prompt", "x", "--threads", "4294967296"], "--threads must be ≤ 1024, got 4294967296"),
             ([out, "--prompt", "x", "--seed", "-1"], "--seed must be ≥ 0, got -1"),
             ([out, "--prompt", "x", "--temperature", "-1"], "--temperature must be ≥ 0, got -1"),
             ([out, "--prompt", "x", "--threads", "two"], "invalid int value: 'two'"),
             ([out, "--prompt", "x", "--isa", "sse"], "invalid choice: 'sse'"),
             ([out, "--prompt", "x", "--bogus"], "unrecognized argument: --bogus"),
             ([str(exported_smollm / "saved"), "--prompt", "x"], "is not a standalone export"),
             ([out, "--prompt", "x", "--max-new-tokens", "9000"], "does not fit the model's 8192")]
    for args, message in cases:
        done = _native(*args)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, (args, done.stderr)
    broken = tmp_path / "broken"
    broken.mkdir()
    for content, message in [(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": [1, 2,]}   ", "JSON: unexpected character"),
                             (b"\xff" * 16, "runs past the end of the file"), (b"\x02" + b"\x00" * 7 + b"{}",
                                                                             "has no standalone metadata")]:
        (broken / FILE).write_bytes(content)  # the runner's own header parser (csrc/text/json_value.h) on bad files
        done = _native(str(broken), "--prompt", "x")
        assert done.returncode == 2 and message in done.stderr, (content, done.stderr)
    saved = _saved(tmp_path, "llama", Recipe("rtn", w_bits=4, group_size=64))  # a tiny model: no tokenizer.json
    export(saved, tmp_path / "bare", to="standalone")
    done = _native(str(tmp_path / "bare"), "--prompt", "x")
    assert done.returncode == 2 and "tokenizer is not one the native runner reads (no tokenizer.json)" in done.stderr
    assert "neither bitquilt-run nor bitquilt-native can generate text from it" in done.stderr  # not "use the other"
    assert "usage: bitquilt-native" in _native("--help").stdout
