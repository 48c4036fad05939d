"""The native runner's tokenizer (csrc/text/bpe_tokenizer.h, tables from bitquilt.export.tokenizer_tables) gives the ids
and text of Hugging Face's `tokenizers` on the same tokenizer.json, for each pre-tokenizer it knows."""

import ctypes
import json
import random

import pytest
from safetensors.torch import save_file
from tokenizers import Tokenizer

from bitquilt.data.corpora import load_documents
from bitquilt.export.tokenizer_tables import Unsupported, tokenizer_tables
from bitquilt.models.registry import DEFAULT_MODEL, model_dir
from bitquilt.runtime.standalone.library import last_error, library
from bitquilt.runtime.standalone.model import FILE, FORMAT_VERSIONS, METADATA_KEY
from bitquilt.runtime.tokenizer import QWEN2_SPLIT

EDGE_CASES = [
    "The capital of France is", "  leading and trailing  ", "tabs\tand\nnew\r\nlines\n\n\n  \n", "a  \n\n  b",
    "I'm, you're, we've, they'll, he'd, it's, don't; I'M YOU'RE It'S 'll 'Ve", "numbers 1 12 123 1234 12345 3.14159",
    "x=1+2*(3-4)/5; y = [1,2,3]", "émigré café naïve Ærøskøbing", "한국어 문장입니다. 중국어: 你好，世界！",
    "日本語のテキスト、カタカナ。", "emoji 😀👍🏽 and ZWJ 👩‍👩‍👧", "Ελληνικά и русский текст",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|endoftext|>x<|im_end|>",
    "…—–“quotes” ‘single’ «guillemets»", "\u00a0non\u2009breaking\u3000spaces\u2028and\u2029separators",
    "٣٤٥ Arabic-Indic digits ⅻ Ⅳ ½ ²", "a" * 300, "z" * 4000 + "ab" * 1500, " " * 17 + "x", "!!!???...\n\n\n",
    "'", "' s", "ſ 'ſ 'S",
    "\x00\x01\x1f control \x7f", "mixed123abc456 def", "a\r\r\n\nb\n \n c", "end with spaces   ",
    # canonical equivalents: decomposed accents, conjoining jamo, marks out of order, singletons, exclusions
    "cafe\u0301 nai\u0308ve A\u030a \u212b \u2126 \u0958 \u0344 \u1e0b\u0323 \u0071\u0307\u0323",
    "\u1100\u1161\u11a8 \u1100\u1161 \uac00\u11a8 \u1112\u1161\u11ab\u1100\u1173\u11af",
    "a\u0301\u0316\u0300 \u0301leading mark, Tie\u0302\u0301ng Vie\u0323\u0302t",
]


def _soup(seed: int, n: int = 60) -> str:
    """Random letters, combining marks and jamo: whatever NFC can reorder or compose."""
    pool = [*"aeiouAEIOUnNcCsS ", *map(chr, range(0x300, 0x370)), *map(chr, range(0x1100, 0x1113)),
            *map(chr, range(0x1161, 0x1176)), *map(chr, range(0x11A8, 0x11C3)), "\u0915", "\u093c", "\u094d"]
    draws = random.Random(seed)
    return "".join(draws.choice(pool) for _ in range(n))


def _spec(pre_tokenizer=None, normalizer=None):
    spec = json.loads((model_dir(DEFAULT_MODEL) / "tokenizer.json").read_text())
    if pre_tokenizer is not None:
        spec["pre_tokenizer"] = pre_tokenizer
    spec["normalizer"] = normalizer
    return spec


PRE_TOKENIZERS = {
    "gpt2": None,  # smollm2's own
    "gpt2-digits": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
    "qwen2": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
}


class NativeTokenizer:
    """The library's tokenizer over a file holding only the tables of `spec` (the runner reads the same)."""

    def __init__(self, spec, tmp_path):
        directory = tmp_path / "tokenizer"
        directory.mkdir()
        (directory / "tokenizer.json").write_text(json.dumps(spec))
        tensors, metadata = tokenizer_tables(directory)
        save_file(tensors, str(directory / FILE),
                  metadata={METADATA_KEY: json.dumps({"format_version": FORMAT_VERSIONS[0], "tokenizer": metadata})})
        self.lib = library()
        file = self.lib.bq_file_open(str(directory / FILE).encode())
        assert file, last_error()
        self.handle = self.lib.bq_tokenizer_open(file)
        self.lib.bq_file_free(file)  # the tokenizer keeps the mapping
        assert self.handle, last_error()
        self.metadata = metadata

    def encode(self, text: str) -> list[int]:
        data = text.encode()
        ids = (ctypes.c_int64 * (len(data) + 8))()
        n = self.lib.bq_tokenize(self.handle, data, len(data), ids, len(ids))
        assert n >= 0, last_error()
        return list(ids[:n])

    def decode(self, ids: list[int], skip_special: bool) -> str:
        array = (ctypes.c_int64 * len(ids))(*ids)
        out = ctypes.create_string_buffer(64 * len(ids) + 1)
        n = self.lib.bq_detokenize(self.handle, array, len(ids), int(skip_special), out, len(out))
        return out.raw[:n].decode("utf-8", "replace")


@pytest.mark.parametrize("name, normalizer", [*((name, None) for name in PRE_TOKENIZERS), ("qwen2", "NFC")])
def test_native_tokenizer_gives_the_ids_and_text_of_the_tokenizers_library(tmp_path, name, normalizer):
    spec = _spec(PRE_TOKENIZERS[name], normalizer and {"type": normalizer})  # Qwen2 as transformers saves it: NFC
    reference = Tokenizer.from_str(json.dumps(spec))
    native = NativeTokenizer(spec, tmp_path)
    assert native.metadata["pre_tokenizer"] == name and native.metadata["normalizer"] == (normalizer and "nfc")
    texts = EDGE_CASES + [_soup(seed) for seed in range(100)] + load_documents("wiki")[:150]
    for text in texts:
        assert native.encode(text) == reference.encode(text).ids, text
    draws = random.Random(0)
    for _ in range(200):  # random ids: partial characters, special tokens, ids past the vocabulary
        ids = [draws.randrange(reference.get_vocab_size() + 40) for _ in range(draws.randrange(1, 12))]
        for skip in (True, False):
            assert native.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip), ids


def test_native_tokenizer_refuses_what_it_cannot_reproduce(tmp_path):
    spec = _spec()
    cases = [({"normalizer": {"type": "NFKC"}}, "normalizer NFKC"), ({"decoder": {"type": "Metaspace"}}, "decoder"),
             ({"pre_tokenizer": {"type": "Whitespace"}}, "pre-tokenizer"),
             ({"model": {**spec["model"], "byte_fallback": True}}, "byte fallback"),
             ({"normalizer": {"type": "NFC"}, "added_tokens": [{**spec["added_tokens"][0], "normalized": True}]},
              "matched in normalized text")]
    for i, (change, reason) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "tokenizer.json").write_text(json.dumps({**spec, **change}))
        with pytest.raises(Unsupported, match=reason):
            tokenizer_tables(tmp_path / str(i))
    with pytest.raises(Unsupported, match="no tokenizer.json"):
        tokenizer_tables(tmp_path)
    native = NativeTokenizer(spec, tmp_path)
    data = b"caf\xe9"  # Latin-1, not UTF-8
    assert native.lib.bq_tokenize(native.handle, data, len(data), None, 0) == -1
    assert "not UTF-8" in last_error()


def _sentencepiece_spec() -> dict:
    """A SentencePiece-style tokenizer.json as Gemma's is built (spaces as "▁", one piece, BPE over characters with
    `<0xNN>` byte fallback in the vocabulary, <bos> before a text), trained on a little wiki text with a small
    alphabet so that many characters fall back to their bytes."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=1500, limit_alphabet=120, show_progress=False,
                                  special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"])
    tokenizer.train_from_iterator(load_documents("wiki")[:300], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # the byte tokens are ordinary vocabulary entries, as in Gemma's
        vocab[f"<0x{b:02X}>"] = len(vocab)
    return spec


def test_native_tokenizer_runs_sentencepiece_style_bpe_as_the_tokenizers_library(tmp_path):
    spec = _sentencepiece_spec()
    reference = Tokenizer.from_str(json.dumps(spec))
    native = NativeTokenizer(spec, tmp_path)
    assert native.metadata["pre_tokenizer"] == "sentencepiece" and native.metadata["prefix"] == [2]
    texts = EDGE_CASES + ["<start_of_turn>user\nHi <start_of_turn> there"] + [_soup(seed) for seed in range(30)] + \
        load_documents("wiki")[300:400]
    fallback = 0
    for text in texts:
        ids = reference.encode(text).ids
        assert native.encode(text) == ids, text
        fallback += sum(reference.id_to_token(i).startswith("<0x") for i in ids)
    assert fallback > 100  # characters outside the small alphabet went through byte fallback
    draws = random.Random(0)
    for _ in range(200):
        ids = [draws.randrange(reference.get_vocab_size() + 40) for _ in range(draws.randrange(1, 12))]
        for skip in (True, False):
            assert native.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip), ids
