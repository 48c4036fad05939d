"""A byte-level or SentencePiece-style BPE tokenizer.json as tables in the standalone file, for the native runner's
tokenizer (csrc/text/bpe_tokenizer.h), which then needs neither Python nor a JSON tokenizer library.

Tensors (`tokenizer.*`):
  token_bytes  uint8   every token's bytes, concatenated by id (byte-level characters mapped back to bytes; an added
                       token's text as UTF-8)
  token_ends   int64   [ids + 1]: token i is token_bytes[token_ends[i]:token_ends[i + 1]] (empty: no such id)
  byte_ids     int32   [256]: the token of each single byte, where BPE starts (-1: none; BPE drops the byte)
  merges       int32   [merges, 4]: (left, right, rank, merged token), sorted by (left, right) for binary search
  added        int32   [added, 2]: (id, special) of the added tokens, split out of the text before BPE
  letters      int32   [ranges, 2]: code point ranges (inclusive) of \\p{L}, from this Python's `unicodedata`
  numbers      int32   [ranges, 2]: the same for \\p{N}
and, where the tokenizer normalizes text to NFC, Unicode's canonical data from this Python's `unicodedata` (Hangul
syllables are computed, not listed):
  nfc_decompositions  int32  [n, 5]: code point, its full canonical decomposition (up to 4, -1 after)
  nfc_classes         int32  [n, 2]: code point, canonical combining class (nonzero ones only)
  nfc_compositions    int32  [n, 3]: first, second, their primary composite (sorted by the pair)
and in the metadata: the normalizer ("nfc" or none), the pre-tokenizer ("gpt2": GPT-2's split; "gpt2-digits": every
digit alone first, then GPT-2's split; "qwen2": Qwen2's Split regex; "sentencepiece", below), the ids the
post-processor puts before and after a text, and the end-of-sequence id.

A SentencePiece-style tokenizer (Gemma's: spaces normalized to "▁", the text between added tokens one piece, BPE over
its characters, a character without a token as its UTF-8 bytes' `<0xNN>` tokens, decoding "▁" as a space and
`<0xNN>` as its byte) is pre-tokenizer "sentencepiece": `token_bytes` holds the decoded bytes, `byte_ids` the
`<0xNN>` tokens, and one more table where BPE starts:
  chars        int32   [n, 2]: (code point, id) of every one-character token (its text as in the vocabulary, "▁" for
                       a space), sorted by code point What the native tokenizer does not reproduce (another model type,
normalizer, pre-tokenizer or decoder, merges that can be skipped, added tokens that strip spaces or are matched in
normalized text) is refused with the reason: the export still runs with `bitquilt-run`, whose `tokenizers` library
reads tokenizer.json.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import torch

from bitquilt.runtime.tokenizer import QWEN2_SPLIT, TOKENIZER_FILE, FastTokenizer, pre_tokenizer_steps

PRE_TOKENIZERS = {  # tokenizer.json's pre-tokenizer steps -> the native tokenizer's name for the same split
    ("ByteLevel regex",): "gpt2",
    ("Digits individual", "ByteLevel regex"): "gpt2-digits",
    (f"Split {QWEN2_SPLIT}", "ByteLevel"): "qwen2",
}


class Unsupported(Exception):
    """The tokenizer is not one the native tokenizer reproduces (the message says why)."""


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level characters: character -> byte (printable Latin-1 bytes are themselves, the other 68 bytes
    the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


def category_ranges(prefix: str) -> list[tuple[int, int]]:
    """Inclusive code point ranges whose Unicode general category starts with `prefix` ("L": letters, "N": numbers)."""
    ranges: list[tuple[int, int]] = []
    for cp in range(0x110000):
        if unicodedata.category(chr(cp)).startswith(prefix):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return ranges


HANGUL_SYLLABLES = range(0xAC00, 0xD7A4)  # composed and decomposed arithmetically (csrc/text/bpe_tokenizer.cpp)


def nfc_tables() -> dict[str, torch.Tensor]:
    """Canonical decompositions, combining classes and primary composites (module docstring)."""
    decompositions, classes, compositions = [], [], []
    for cp in range(0x110000):
        if cp in HANGUL_SYLLABLES:
            continue
        c = chr(cp)
        full = unicodedata.normalize("NFD", c)
        if full != c:
            decompositions.append([cp, *map(ord, full), *[-1] * (4 - len(full))])
        if unicodedata.combining(c):
            classes.append([cp, unicodedata.combining(c)])
        one_level = unicodedata.decomposition(c)
        if one_level and not one_level.startswith("<"):
            parts = [int(x, 16) for x in one_level.split()]
            if len(parts) == 2 and unicodedata.normalize("NFC", chr(parts[0]) + chr(parts[1])) == c:
                compositions.append([*parts, cp])  # not a composition exclusion
    compositions.sort()
    return {f"tokenizer.nfc_{name}": torch.tensor(rows, dtype=torch.int32) for name, rows in
            (("decompositions", decompositions), ("classes", classes), ("compositions", compositions))}


def _template_ends(post: dict[str, Any] | None, ids_of: dict[str, int]) -> tuple[list[int], list[int]]:
    """The ids a post-processor adds before and after a single text."""
    if post is None or post["type"] == "ByteLevel":
        return [], []
    if post["type"] != "TemplateProcessing":
        raise Unsupported(f"post-processor {post['type']}")
    single = post["single"]
    sequence = [i for i, piece in enumerate(single) if "Sequence" in piece]
    if len(sequence) != 1:
        raise Unsupported("a post-processor template without exactly one sequence")
    ends: tuple[list[int], list[int]] = ([], [])
    for i, piece in enumerate(single):
        if "SpecialToken" in piece:
            name = piece["SpecialToken"]["id"]
            ids = post["special_tokens"][name]["ids"] if name in post.get("special_tokens", {}) else [ids_of[name]]
            ends[i > sequence[0]].extend(ids)
    return ends


SPACE = "▁"  # SentencePiece's space
SENTENCEPIECE = {  # the steps of a SentencePiece-style tokenizer.json (Gemma's), as the native tokenizer runs them
    "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
    # after the normalizer no space is left to split at: the text stays one piece
    "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
    "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                                                 {"type": "ByteFallback"}, {"type": "Fuse"}]},
}


def _sentencepiece(spec: dict[str, Any]) -> bool:
    """Whether `spec` is SentencePiece-style (module docstring); False for anything else."""
    return spec.get("normalizer") == SENTENCEPIECE["normalizer"] and spec.get("decoder") == SENTENCEPIECE["decoder"] \
        and spec.get("pre_tokenizer") in (None, SENTENCEPIECE["pre_tokenizer"])


def _check_model(spec: dict[str, Any], sentencepiece: bool) -> None:
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise Unsupported(f"model type {model.get('type')} (the native tokenizer runs BPE)")
    if model.get("dropout") or model.get("byte_fallback") != sentencepiece or model.get("ignore_merges") or \
            model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise Unsupported("BPE with dropout, skipped merges, subword affixes, or byte fallback other than "
                          "SentencePiece's")
    normalizer = spec.get("normalizer")
    if not sentencepiece and normalizer is not None and normalizer.get("type") != "NFC":
        raise Unsupported(f"normalizer {normalizer.get('type')}")
    if not sentencepiece and (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise Unsupported(f"decoder {(spec.get('decoder') or {}).get('type')}")
    for token in spec.get("added_tokens", []):
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            raise Unsupported(f"added token {token['content']!r} strips spaces or matches whole words only")
        if normalizer is not None and token.get("normalized"):
            raise Unsupported(f"added token {token['content']!r} matched in normalized text")


def tokenizer_tables(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tables of `directory`'s tokenizer.json and their metadata (module docstring); raises Unsupported."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise Unsupported(f"no {TOKENIZER_FILE}")
    spec = json.loads(path.read_text())
    sentencepiece = _sentencepiece(spec)
    _check_model(spec, sentencepiece)
    steps = pre_tokenizer_steps(spec.get("pre_tokenizer"))
    if not sentencepiece and steps not in PRE_TOKENIZERS:
        raise Unsupported(f"pre-tokenizer {' + '.join(steps) or 'none'}")
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens, byte_ids = _sentencepiece_bytes(vocab) if sentencepiece else _byte_level_bytes(vocab)
    added = sorted((t["id"], bool(t["special"])) for t in spec.get("added_tokens", []))
    for t in spec.get("added_tokens", []):
        tokens[t["id"]] = t["content"].encode()
    ends = [0]
    for i in range(max(tokens) + 1):
        ends.append(ends[-1] + len(tokens.get(i, b"")))
    merges = []
    for rank, merge in enumerate(spec["model"]["merges"]):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise Unsupported(f"merge {left!r} + {right!r} of tokens not in the vocabulary")
        merges.append((vocab[left], vocab[right], rank, vocab[left + right]))
    merges.sort()
    ids_of = {**vocab, **{t["content"]: t["id"] for t in spec.get("added_tokens", [])}}
    prefix, suffix = _template_ends(spec.get("post_processor"), ids_of)

    def table(rows: list[Any], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(rows, dtype=dtype).contiguous()

    tensors = {
        "tokenizer.token_bytes": torch.frombuffer(bytearray(b"".join(tokens.get(i, b"") for i in range(len(ends) - 1))),
                                                  dtype=torch.uint8).clone(),
        "tokenizer.token_ends": table(ends, torch.int64),
        "tokenizer.byte_ids": table(byte_ids),
        "tokenizer.merges": table(merges).reshape(-1, 4),
        "tokenizer.added": table(added).reshape(-1, 2),
        "tokenizer.letters": table(category_ranges("L")),
        "tokenizer.numbers": table(category_ranges("N")),
    }
    normalizer = "nfc" if spec.get("normalizer") is not None and not sentencepiece else None
    if normalizer:
        tensors.update(nfc_tables())
    if sentencepiece:
        fallback = set(byte_ids)
        chars = sorted((ord(text), i) for text, i in vocab.items() if len(text) == 1 and i not in fallback)
        tensors["tokenizer.chars"] = table(chars).reshape(-1, 2)
    eos = FastTokenizer(directory).eos_token_id
    return tensors, {"normalizer": normalizer,
                     "pre_tokenizer": "sentencepiece" if sentencepiece else PRE_TOKENIZERS[steps], "prefix": prefix,
                     "suffix": suffix, "eos": eos}


def _byte_level_bytes(vocab: dict[str, int]) -> tuple[dict[int, bytes], list[int]]:
    """Each token's bytes (its byte-level characters mapped back) and the token of each single byte (-1: none)."""
    alphabet = byte_level_alphabet()
    tokens: dict[int, bytes] = {}
    for text, i in vocab.items():
        if any(c not in alphabet for c in text):
            raise Unsupported(f"token {text!r} has characters outside the byte-level alphabet")
        tokens[i] = bytes(alphabet[c] for c in text)
    byte_of = {b: c for c, b in alphabet.items()}
    return tokens, [vocab.get(byte_of[b], -1) for b in range(256)]


def _sentencepiece_bytes(vocab: dict[str, int]) -> tuple[dict[int, bytes], list[int]]:
    """Each token's decoded bytes ("▁" a space, `<0xNN>` its byte) and the `<0xNN>` token of each byte (-1: none)."""
    byte_ids = [vocab.get(f"<0x{b:02X}>", -1) for b in range(256)]
    byte_of = {i: b for b, i in enumerate(byte_ids) if i >= 0}
    tokens = {i: bytes([byte_of[i]]) if i in byte_of else text.replace(SPACE, " ").encode()
              for text, i in vocab.items()}
    return tokens, byte_ids
