"""GGUF export checked in llama.cpp: the same perplexity windows scored by bitquilt and by llama.cpp.

Per configuration (the FP model as a control, then RTN W4 g32 asymmetric → Q4_1, symmetric → Q4_0 and W8 g32
symmetric → Q8_0; RTN needs no calibration; `rtn w4 g32 sym as f32`, not in the defaults: those W4 weights dequantized
and saved as a full-precision model, which llama.cpp then multiplies in F32 without rounding activations): quantize
with bitquilt, save, `bitquilt.api.export` to GGUF, then
  weights   every quantized GGUF tensor dequantized by gguf's reference (`gguf.quants.dequantize`) against
            bitquilt's dequantized weight (q/k rows put back in Hugging Face order): max |difference|
  bitquilt  the saved model loaded back (`load_quantized`), its logits on the first --windows × --seqlen windows
            of --ppl-data (`bitquilt.data.windows.eval_windows`, as `bitquilt eval` makes them)
  llama.cpp the GGUF file in llama.cpp (xllamacpp's CPU wheel, default settings: F16 KV cache, activations
            rounded to Q8 in the Q4/Q8 matmuls) fed the same token ids. llama.cpp's server returns no prompt
            log-probabilities, so its `/embedding` endpoint (pooling none) gives each position's final-norm
            hidden state, and the logits are that times the GGUF's own F32 output matrix (read from the file);
            `/completion` with n_probs cross-checks this against llama.cpp's own LM head at the last position.
  Q8 acts.  for quantized models, bitquilt again with every quantized linear's input rounded as llama.cpp's CPU
            matmuls round it (Q8 blocks of 32, d = max|x|/127; bitquilt's 8-bit symmetric g32 activation
            quantizer), compared with bitquilt without: the size of the gap that rounding alone opens. It cannot
            be emulated bit for bit: the rounding is discontinuous, so any last-bit difference (llama.cpp stores d
            in fp16, sums in another order, keeps the KV cache in F16) flips other roundings downstream.
Perplexity is bitquilt's: exp of the mean over windows of the mean −log p(x_t | x_<t), t ≥ 1.

llama.cpp is an optional bench dependency in a venv of its own (a prebuilt CPU wheel, no compiling;
llama-cpp-python has no wheel on PyPI); the bench runs it in a subprocess of that venv's Python (`bench/llamacpp.py`):

    python3 -m venv .venv-llamacpp
    .venv-llamacpp/bin/pip install xllamacpp==2026.10.11549 numpy

    .venv/bin/python bench/export_gguf.py            # smollm2-135m, 4 windows × 512 tokens of wiki
    .venv/bin/python bench/export_gguf.py --model DIR --tokenizer-from ORIGINAL.gguf   # a Hugging Face folder

--model takes a packaged name or a Hugging Face folder (records are named by the folder's name); a model whose
tokenizer the exporter cannot describe to llama.cpp (Gemma's SentencePiece) takes its vocabulary from
--tokenizer-from, a GGUF of the same model.

Results: bench/results/export_gguf.{json,md}, one record per model (a new run replaces the model's record);
the saved models and GGUF files stay in --workdir.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

import llamacpp

ROOT = llamacpp.ROOT
TOP_K = 5  # llama.cpp's own log-probabilities compared at the last position of each window


# ---------------------------------------------------------------- llama.cpp side (runs in .venv-llamacpp)
def llamacpp_worker(gguf_file: str, ids_file: str, out_file: str, threads: int) -> None:
    """Hidden states of every window (npz `hidden` [n, seqlen, d]) and llama.cpp's top-k log-probabilities at
    the last position (`top_ids`, `top_logprobs` [n, k]) of the GGUF model on the token ids in `ids_file`."""
    import numpy as np
    import xllamacpp as xlc

    ids = np.load(ids_file)
    server = llamacpp.server(gguf_file, threads, n_ctx=ids.shape[1], n_batch=ids.shape[1], n_ubatch=ids.shape[1],
                             embedding=True, pooling_type=xlc.llama_pooling_type.LLAMA_POOLING_TYPE_NONE,
                             warmup=False)

    def post(path: str, body: dict) -> object:
        request = urllib.request.Request(server.listening_address + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())

    hidden, top_ids, top_logprobs = [], [], []
    t0 = time.perf_counter()
    for window in ids.tolist():
        hidden.append(np.asarray(post("/embedding", {"content": window})[0]["embedding"], dtype=np.float32))
    seconds = time.perf_counter() - t0
    for window in ids.tolist():
        reply = post("/completion", {"prompt": window[:-1], "n_predict": 1, "n_probs": TOP_K, "temperature": 0,
                                     "cache_prompt": False})
        top = reply["completion_probabilities"][0]["top_logprobs"]
        top_ids.append([t["id"] for t in top])
        top_logprobs.append([t["logprob"] for t in top])
    np.savez(out_file, hidden=np.stack(hidden), top_ids=np.array(top_ids), top_logprobs=np.array(top_logprobs),
             seconds=seconds, version=xlc.__version__)


# ---------------------------------------------------------------- bitquilt side
def main() -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from common import Bench, command_line, loadavg, machine, run

    from bitquilt.api import export, load, quantize, save
    from bitquilt.data.windows import eval_windows
    from bitquilt.errors import UserError
    from bitquilt.export.gguf import FAMILIES, rotary_order
    from bitquilt.io import load_quantized
    from bitquilt.nn.act_quant import ActQuantConfig, ActQuantizer
    from bitquilt.nn.online import attach
    from bitquilt.nn.quant_linear import QuantLinear
    from bitquilt.recipes import Recipe

    configs = {"fp32": None,
               "rtn w4 g32 asym": Recipe("rtn", w_bits=4, group_size=32, sym=False),
               "rtn w4 g32 sym": Recipe("rtn", w_bits=4, group_size=32, sym=True),
               "rtn w8 g32 sym": Recipe("rtn", w_bits=8, group_size=32, sym=True),
               "rtn w4 g32 sym as f32": Recipe("rtn", w_bits=4, group_size=32, sym=True)}
    as_f32 = {"rtn w4 g32 sym as f32"}  # saved with the quantized weights dequantized: F32 tensors in the GGUF
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="packaged name or Hugging Face folder")
    p.add_argument("--tokenizer-from", help="GGUF of the same model whose vocabulary the export copies")
    p.add_argument("--configs", default=",".join(c for c in configs if c not in as_f32),
                   help=f"comma-separated subset of: {', '.join(configs)}")
    p.add_argument("--ppl-data", default="wiki")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads")
    p.add_argument("--workdir", default=str(ROOT / "out" / "export_gguf"), help="saved models and GGUF files")
    p.add_argument("--llamacpp-python", default=str(llamacpp.PYTHON), help="Python of the venv with xllamacpp")
    args = p.parse_args()

    def gguf_weights_check(model: torch.nn.Module, path: Path) -> float:
        """max |gguf dequantized − bitquilt dequantized| over the quantized linears (q/k rows in GGUF order)."""
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        family = FAMILIES[model.config.model_type]
        names = gguf.get_tensor_name_map(family.arch, model.config.num_hidden_layers)
        worst = 0.0
        for name, m in model.named_modules():
            if isinstance(m, QuantLinear):
                t = tensors[names.get_name(f"{name}.weight", try_suffixes=(".weight",))]
                ours = m.fmt.dequantize()
                heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
                if family.rotary_rows and name.rsplit(".", 1)[1] in heads:
                    ours = ours[rotary_order(ours.shape[0], heads[name.rsplit(".", 1)[1]])]
                got = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
                worst = max(worst, float((got - ours).abs().max()))
        return worst

    def dequantized(model: torch.nn.Module) -> None:
        """Each quantized linear replaced by a full-precision one holding its dequantized weight."""
        for name, m in list(model.named_modules()):
            if isinstance(m, QuantLinear):
                linear = torch.nn.Linear(m.fmt.in_features, m.fmt.out_features, bias=m.bias is not None)
                linear.weight.data, linear.bias = m.fmt.dequantize(), m.bias
                model.set_submodule(name, linear)

    def logits_of(model: torch.nn.Module, windows: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(ids[None], use_cache=False).logits[0].float() for ids in windows]

    def perplexity(logits: list[torch.Tensor], windows: torch.Tensor) -> float:
        """exp of the mean window loss, each loss as `bitquilt.eval.ppl.window_losses` computes it."""
        return float(np.exp(np.mean([float(F.cross_entropy(x[:-1], ids[1:])) for x, ids in zip(logits, windows)])))

    def agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
        """Max and mean |a − b| over all positions and the vocabulary, and the share of equal argmax."""
        return {"logits_max_abs_diff": max(float((x - y).abs().max()) for x, y in zip(a, b)),
                "logits_mean_abs_diff": float(np.mean([float((x - y).abs().mean()) for x, y in zip(a, b)])),
                "top1_agreement": float(np.mean([float((x.argmax(-1) == y.argmax(-1)).float().mean())
                                                 for x, y in zip(a, b)]))}

    def output_matrix(path: Path) -> torch.Tensor:
        """The GGUF's LM head: `output.weight`, or the tied `token_embd.weight` (F32 as exported)."""
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        t = tensors.get("output.weight", tensors["token_embd.weight"])
        return torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))

    def bench() -> None:
        torch.set_num_threads(args.threads)
        python = llamacpp.check_python(args.llamacpp_python)
        unknown = [c for c in args.configs.split(",") if c not in configs]
        if unknown:
            raise UserError(f"unknown configs {unknown}; known: {', '.join(configs)}")
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
        rows, name = [], Path(args.model).name
        for label in args.configs.split(","):
            recipe, slug = configs[label], f"{name}-{label.replace(' ', '-')}"
            saved, gguf_file = work / slug, work / f"{slug}.gguf"
            model, tokenizer = load(args.model)
            if recipe is not None:
                quantize(model, recipe, progress=False)
            if label in as_f32:
                dequantized(model)
            save(model, saved, tokenizer=tokenizer, overwrite=True)
            summary = export(saved, gguf_file, overwrite=True, tokenizer_from=args.tokenizer_from)
            model, tokenizer = load_quantized(saved)
            windows = eval_windows(tokenizer, args.ppl_data, args.seqlen, args.windows)
            np.save(work / "ids.npy", windows.numpy().astype(np.int32))
            llamacpp.run_worker([str(python), __file__, "--worker", str(gguf_file), str(work / "ids.npy"),
                                 str(work / "llamacpp.npz"), str(args.threads)], f"llama.cpp on {gguf_file}")
            ll = np.load(work / "llamacpp.npz")
            head = output_matrix(gguf_file)
            ll_logits = [torch.from_numpy(h) @ head.T for h in ll["hidden"]]
            head_diff = max(float((torch.log_softmax(logits[-2], -1)[torch.from_numpy(top_ids)]
                                   - torch.from_numpy(top_lp).float()).abs().max())
                            for logits, top_ids, top_lp in zip(ll_logits, ll["top_ids"], ll["top_logprobs"]))
            t0 = time.perf_counter()
            ours = logits_of(model, windows)
            bq_seconds = time.perf_counter() - t0
            q8 = {}
            # llama.cpp rounds the input of each Q4/Q8 matmul to Q8 blocks: how much that moves
            if recipe is not None and label not in as_f32:
                for m in model.modules():
                    if isinstance(m, QuantLinear):
                        attach(m, "act_quant", ActQuantizer(ActQuantConfig(bits=8, sym=True, group_size=32)))
                rounded = logits_of(model, windows)
                q8 = {"q8_acts_ppl_bitquilt": perplexity(rounded, windows),
                      **{f"q8_acts_effect_{k}": v for k, v in agreement(ours, rounded).items()}}
            ppl, ll_ppl = perplexity(ours, windows), perplexity(ll_logits, windows)
            row = {"config": label, "gguf_types": summary.tensors, "gguf_mb": summary.size_mb,
                   "export_seconds": summary.seconds, "q4_1_rounded_minima": summary.q4_1_rounded_minima,
                   "q4_1_blocks": summary.q4_1_blocks, "q4_1_max_shift_steps": summary.q4_1_max_shift_steps,
                   "tokenizer": summary.tokenizer, "weights_max_abs_diff": gguf_weights_check(model, gguf_file),
                   "ppl_bitquilt": ppl, "ppl_llamacpp": ll_ppl, "ppl_rel_diff": abs(ll_ppl - ppl) / ppl,
                   **agreement(ours, ll_logits), **q8, "lm_head_check_max_abs_diff": head_diff,
                   "bitquilt_seconds": bq_seconds, "llamacpp_seconds": float(ll["seconds"])}
            rows.append(row)
            print(f"[{label}] " + ", ".join(f"{k}={v:.4g}" for k, v in row.items() if isinstance(v, float)),
                  file=sys.stderr, flush=True)
        versions = {**machine(), "gguf": version("gguf"), "xllamacpp": str(ll["version"]), "loadavg": loadavg()}
        record = {"model": name, "settings": {"ppl_data": args.ppl_data, "windows": args.windows,
                                                    "seqlen": args.seqlen},
                  "threads": args.threads, "machine": versions, "command": command_line(), "rows": rows}
        Bench("export_gguf", ("model",), render).store(record)

    run(bench)


def render(records: list[dict]) -> str:
    from common import fmt_ppl

    lines = ["# GGUF export in llama.cpp", "",
             "Generated by `bench/export_gguf.py`: each model quantized and saved by bitquilt, exported with "
             "`bitquilt export --to gguf`, and scored on the same token ids by bitquilt (the saved model loaded "
             "back) and by llama.cpp (the GGUF file, xllamacpp CPU wheel, default settings). llama.cpp's logits "
             "are its final-norm hidden states (`/embedding`, pooling none) times the GGUF's F32 output matrix; "
             "*LM head check* compares them with llama.cpp's own top-5 log-probabilities (`/completion`) at the "
             "last position of each window. *weights* is the largest |gguf − bitquilt| over every quantized "
             "weight (gguf's reference dequantizer): 0 is bit-exact; for Q4_1 it is the fp16 rounding of the "
             "block minima m = −s·z (*rounded minima*, at most *max shift* of a step). *Q8 acts*: bitquilt with "
             "each quantized linear's input rounded to Q8 blocks of 32, as llama.cpp's CPU matmuls round it, "
             "against bitquilt without: the gap that this rounding alone opens (it cannot be reproduced bit for bit: "
             "rounding is discontinuous, and any last-bit difference flips other roundings downstream).", ""]
    for record in records:
        lines += section(record, fmt_ppl)
    return "\n".join(lines)


def section(record: dict, fmt_ppl) -> list[str]:
    s = record["settings"]
    lines = [f"## {record['model']}", "",
             f"First {s['windows']} windows × {s['seqlen']} tokens of `{s['ppl_data']}`; {record['threads']} threads. "
             f"Machine and versions: {record['machine']}.", "",
             f"Command: `{record['command']}`", "",
             "### Weights", "",
             "| config | GGUF tensors | GGUF MB | export s | weights max diff | rounded Q4_1 minima "
             "| max shift (steps) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in record["rows"]:
        types = ", ".join(f"{k} {v}" for k, v in r["gguf_types"].items())
        minima = f"{r['q4_1_rounded_minima']:,} / {r['q4_1_blocks']:,}" if r["q4_1_blocks"] else ""
        shift = f"{r['q4_1_max_shift_steps']:.4f}" if r["q4_1_blocks"] else ""
        lines.append(f"| {r['config']} | {types} | {r['gguf_mb']:.1f} | {r['export_seconds']:.0f} "
                     f"| {r['weights_max_abs_diff']:.2g} | {minima} | {shift} |")
    lines += ["", "### bitquilt vs llama.cpp on the same token ids", "",
              "| config | ppl bitquilt | ppl llama.cpp | rel. diff | logits max diff | logits mean diff "
              "| top-1 agreement | LM head check | Q8 acts: ppl bitquilt | Q8 acts vs not: logits mean diff "
              "| Q8 acts vs not: top-1 agreement |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in record["rows"]:
        q8 = (f"{fmt_ppl(r['q8_acts_ppl_bitquilt'])} | {r['q8_acts_effect_logits_mean_abs_diff']:.4f} "
              f"| {r['q8_acts_effect_top1_agreement']:.2%}" if "q8_acts_ppl_bitquilt" in r else " | | ")
        lines.append(f"| {r['config']} | {fmt_ppl(r['ppl_bitquilt'])} | {fmt_ppl(r['ppl_llamacpp'])} "
                     f"| {r['ppl_rel_diff']:.3%} | {r['logits_max_abs_diff']:.3f} | {r['logits_mean_abs_diff']:.4f} "
                     f"| {r['top1_agreement']:.2%} | {r['lm_head_check_max_abs_diff']:.1e} | {q8} |")
    return lines + [""]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        llamacpp_worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
