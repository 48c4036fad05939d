"""A model's tokenizer.json run by the `tokenizers` library alone, for the bitquilt runtime.

transformers' AutoTokenizer reads the same file but first imports its tokenizer classes and parses the JSON in
Python again (≈ 0.9 s and ≈ 45 MB more for Qwen's 151,936-entry vocabulary), and the parse's temporaries stay in
the heap (≈ 40 MB more, given back here). Generating text needs three things of a tokenizer: encode a prompt,
decode new ids, know the end-of-sequence id; `FastTokenizer` does those, with the special tokens
tokenizer_config.json names. Tested to give AutoTokenizer's ids and text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bitquilt.errors import UserError
from bitquilt.heap import return_free_memory

TOKENIZER_FILE = "tokenizer.json"
# Qwen2's pre-tokenizer regex (tokenizer.json's Split step before its ByteLevel step)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def _step(step: dict[str, Any]) -> str:
    kind = step["type"]
    if kind == "Split":
        return f"Split {step['pattern'].get('Regex')}"
    if kind == "ByteLevel" and not step.get("add_prefix_space", False):
        return "ByteLevel regex" if step.get("use_regex", True) else "ByteLevel"
    if kind == "Digits" and step.get("individual_digits"):
        return "Digits individual"
    return json.dumps(step, sort_keys=True)


def pre_tokenizer_steps(pre: dict[str, Any] | None) -> tuple[str, ...]:
    """tokenizer.json's `pre_tokenizer` as named steps: "ByteLevel regex" (GPT-2's split, then bytes as characters),
    "ByteLevel" (bytes as characters only), "Digits individual", "Split <regex>", or the step's JSON."""
    steps = [] if pre is None else pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
    return tuple(_step(s) for s in steps)


def _token_text(entry: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": string, ...}."""
    return entry.get("content") if isinstance(entry, dict) else entry


class FastTokenizer:
    """Encode and decode with a directory's tokenizer.json (module docstring)."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        directory = Path(directory)
        try:
            self.backend_tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
            config_path = directory / "tokenizer_config.json"
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except Exception as e:  # OSError, JSON errors, and tokenizers' bare Exception for a bad file
            raise UserError(f"cannot load the tokenizer in {directory}: {e}") from None
        return_free_memory()  # parsing the JSON left ≈ 40 MB of Qwen's free in the heap
        eos = _token_text(config.get("eos_token"))
        self.eos_token = eos
        self.eos_token_id = self.backend_tokenizer.token_to_id(eos) if eos else None

    @staticmethod
    def available(directory: str | Path) -> bool:
        return (Path(directory) / TOKENIZER_FILE).is_file()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict[str, list[int]]:
        """{"input_ids": ids} as a transformers tokenizer returns for one text (`verbose`: accepted, unused)."""
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=bool(skip_special_tokens))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)
