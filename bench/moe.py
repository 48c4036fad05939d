"""Decode speed of a mixture-of-experts model at 1 thread: bitquilt's engines vs llama.cpp on its GGUF export.

Writes a shape-true random checkpoint of OLMoE-1B-7B's block (hidden 2048, 64 experts, 8 per token, expert width 1024,
16 heads, vocabulary 50304; `--layers` of its 16 decoder layers), bf16 N(0, 0.02) weights in one safetensors shard
per layer with the Hub's per-expert names, then:
  quantize  `bitquilt quantize --stream --method rtn --w-bits 4 --group-size 32 --sym` in a child process (wall and
            CPU seconds, peak RSS);
  export    the saved model to GGUF (Q4_0: the same codes and scales, `bitquilt.export.gguf`);
  decode    greedy prompt + new tokens at 1 thread, rounds interleaved: bitquilt (`measure_speed`) with each of
            `--engines` ("lean": the MoE block called module by module, each expert's W4 linears on the rows routed
            to it; "fused": every layer of a step in one compiled call, the router's top-k and each routed expert
            once; "+int8": on int8 activations, as llama.cpp's Q4_0 × Q8_0) and llama.cpp (xllamacpp in its own
            venv, `bench/llamacpp.py`), the load average noted at each measurement.
The saved model borrows the default packaged model's tokenizer (SmolLM2's 49152 tokens, padded to the model's rows)
because llama.cpp generates only with a vocabulary; prompts draw from its ids. Random weights route tokens
near-uniformly, as a trained router does on average; the rate depends on the shape only.

    python bench/moe.py --layers 16 --rounds 3 --engines lean,fused+int8
Writes bench/results/moe.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import llamacpp
import torch
from common import finish, intro, loadavg, run, run_child, run_facts, run_header, write_report
from safetensors.torch import save_file

ROOT = llamacpp.ROOT
# OLMoE-1B-7B-0924's config, but for the layer count
SHAPE = dict(hidden_size=2048, num_experts=64, num_experts_per_tok=8, intermediate_size=1024, num_attention_heads=16,
             num_key_value_heads=16, vocab_size=50304, max_position_embeddings=4096, norm_topk_prob=False,
             rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=50279,
             pad_token_id=1)

TOKENS = 49152  # prompts draw from the lent tokenizer's ids (llama.cpp needs a vocabulary; the rest are padding)


def write_checkpoint(folder: Path, layers: int) -> int:
    """A random bf16 checkpoint of the OLMoE shape with `layers` layers in `folder`; its parameter count."""
    from transformers import OlmoeConfig

    config = OlmoeConfig(num_hidden_layers=layers, **SHAPE)
    config.dtype = "bfloat16"
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    gen = torch.Generator().manual_seed(0)
    d, width, experts = config.hidden_size, config.intermediate_size, config.num_experts

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map, params = {}, 0

    def write(k: int, shard: dict[str, torch.Tensor]) -> None:  # one shard at a time: a layer's weights in memory
        nonlocal params
        name = f"model-{k + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        params += sum(t.numel() for t in shard.values())

    write(0, {"model.embed_tokens.weight": rand(config.vocab_size, d), "lm_head.weight": rand(config.vocab_size, d),
              "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard = {p + n: torch.ones(d, dtype=torch.bfloat16) for n in
                 ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight")}
        shard |= {f"{p}self_attn.{n}.weight": rand(d, d) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        shard[p + "mlp.gate.weight"] = rand(experts, d)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shard |= {q + "gate_proj.weight": rand(width, d), q + "up_proj.weight": rand(width, d),
                      q + "down_proj.weight": rand(d, width)}
        write(i + 1, shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return params


def quantize_child(checkpoint: Path, out: Path) -> dict:
    """`bitquilt quantize --stream` RTN W4 g32 symmetric in a child process at 1 thread: wall, CPU, peak RSS."""
    argv = [sys.executable, "-m", "bitquilt.cli", "quantize", str(checkpoint), "--stream", "--method", "rtn",
            "--w-bits", "4", "--group-size", "32", "--sym", "--threads", "1", "-o", str(out), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    child = run_child(argv, env)
    if child.returncode:
        sys.exit(f"quantize failed: {child.stderr.strip().splitlines()[-1:]}")
    # the peak RSS quantize reports of itself (wait4's ru_maxrss would start from this process's at the fork)
    return {"wall_s": round(child.wall_s, 1), "cpu_s": round(child.cpu_s, 1),
            "peak_rss_mb": round(json.loads(child.stdout)["peak_rss_mb"])}


def bitquilt_speed(saved: Path, prompt_tokens: int, new_tokens: int, engine: str) -> dict:
    from bitquilt import kernels
    from bitquilt.eval.speed import measure_speed
    from bitquilt.io import load_quantized

    model, _ = load_quantized(saved)
    with kernels.using(int8_activations=engine.endswith("+int8")):
        result = measure_speed(model, TOKENS, prompt_tokens, new_tokens, repeats=1,
                               engine=engine.removesuffix("+int8"))
    return {"decode_tokens_per_s": result.decode_tokens_per_s, "prefill_tokens_per_s": result.prefill_tokens_per_s,
            "loadavg": loadavg()}


def llamacpp_speed(python: Path, gguf_file: Path, prompt_tokens: int, new_tokens: int) -> dict:
    prompt = torch.randint(0, TOKENS, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    job = {"gguf": str(gguf_file), "prompt": prompt.tolist(), "new_tokens": new_tokens, "threads": 1,
           "vocab_size": TOKENS}
    r = llamacpp.run_json_worker([str(python), str(ROOT / "bench" / "llamacpp.py"), "speed", json.dumps(job)],
                                 "llama.cpp")
    return {"decode_tokens_per_s": r["decode_tokens_per_s"], "prefill_tokens_per_s": r["prefill_tokens_per_s"],
            "peak_rss_mb": round(r["peak_rss_mb"]), "xllamacpp": r["versions"]["xllamacpp"], "loadavg": loadavg()}


def render(record: dict) -> str:
    q, g, rounds, engines = record["quantize"], record["gguf"], record["rounds"], record["engines"]
    lines = intro("MoE decode: bitquilt vs llama.cpp (OLMoE-1B-7B block shape, random weights)", __doc__
                  .split("\n\n")[0])
    lines += [run_header(record["facts"]), "",
              f"Checkpoint: {record['layers']} of OLMoE-1B-7B's 16 layers, {record['params'] / 1e9:.2f} B parameters "
              f"in bf16 ({record['checkpoint_mb']} MB on disk).", "",
              f"Quantize (`--stream`, RTN W4 g32 sym, 1 thread): {q['wall_s']} s wall, {q['cpu_s']} s CPU, peak RSS "
              f"{q['peak_rss_mb']} MB. GGUF export: {g['seconds']:.1f} s, {g['size_mb']:.0f} MB, "
              f"tensors {g['tensors']}.", "",
              f"Decode at 1 thread, prompt {record['prompt_tokens']} tokens, {record['new_tokens']} new tokens:", "",
              "| round | engine | decode tok/s | prefill tok/s | load average |", "|---|---|---:|---:|---|"]
    for i, measured in enumerate(rounds):
        for engine in [*engines, "llama.cpp"]:
            m = measured[engine]
            lines.append(f"| {i + 1} | {engine} | {m['decode_tokens_per_s']:.2f} | {m['prefill_tokens_per_s']:.1f} | "
                         f"{m['loadavg']} |")
    best = {e: max(r[e]["decode_tokens_per_s"] for r in rounds) for e in [*engines, "llama.cpp"]}
    lines += ["", "Best decode of the rounds: " + ", ".join(
        f"{e} {v:.2f} tok/s ({v / best['llama.cpp']:.2f}× llama.cpp)" for e, v in best.items() if e != "llama.cpp")
        + f"; llama.cpp {best['llama.cpp']:.2f} tok/s.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers (OLMoE-1B-7B has 16)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--work", default="/tmp/bitquilt-moe-bench", help="scratch folder (removed at the end)")
    p.add_argument("--llamacpp-python", default=str(llamacpp.PYTHON), help="Python of the venv with xllamacpp")
    p.add_argument("--engines", default="lean,fused+int8", help="bitquilt decode engines, comma-separated")
    args = p.parse_args()
    engines = args.engines.split(",")
    from bitquilt.api import export
    from bitquilt.models.loading import TOKENIZER_FILES
    from bitquilt.models.registry import DEFAULT_MODEL, fetched_dir

    python = llamacpp.check_python(args.llamacpp_python)
    torch.set_num_threads(1)
    facts = run_facts()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    try:
        params = write_checkpoint(work / "hf", args.layers)
        checkpoint_mb = round(sum(f.stat().st_size for f in (work / "hf").iterdir()) / 2**20)
        quantized = quantize_child(work / "hf", work / "q")
        shutil.rmtree(work / "hf")
        for name in TOKENIZER_FILES:  # a byte-level BPE vocabulary for llama.cpp, padded to the model's rows
            if (fetched_dir(DEFAULT_MODEL) / name).is_file():
                shutil.copy2(fetched_dir(DEFAULT_MODEL) / name, work / "q" / name)
        gguf = export(work / "q", work / "m.gguf").to_dict()
        rounds = [{**{e: bitquilt_speed(work / "q", args.prompt_tokens, args.new_tokens, e) for e in engines},
                   "llama.cpp": llamacpp_speed(python, work / "m.gguf", args.prompt_tokens, args.new_tokens)}
                  for _ in range(args.rounds)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {"layers": args.layers, "params": params, "checkpoint_mb": checkpoint_mb, "quantize": quantized,
              "gguf": gguf, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "engines": engines,
              "rounds": rounds,
              "facts": finish(facts)}
    write_report("moe", record, render)


if __name__ == "__main__":
    run(main)
