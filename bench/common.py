"""Plumbing shared by the benchmark scripts: machine description, the perplexity protocol, result records."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bitquilt.errors import USER_ERRORS

if TYPE_CHECKING:
    from bitquilt.recipes import CalibConfig

RESULTS = Path(__file__).parent / "results"
# GPTQ option sets the benches name (GPTQ's default is act-order + static groups + MSE ranges), spelled
# out in full so that changing a default never changes what a measured row means
GPTQ_PLAIN = {"act_order": False, "static_groups": False, "mse": False}  # the original sweep, as the reference
GPTQ_ACT_ORDER_STATIC = {"act_order": True, "static_groups": True, "mse": False}  # act-order, contiguous groups


def run(main: Callable[[], None]) -> None:
    """A bench's entry point: an error the user can fix (unknown model, not fetched, bad option; the
    CLI's `USER_ERRORS`) is one line on stderr and exit status 1, not a traceback."""
    try:
        main()
    except USER_ERRORS as e:
        sys.exit(f"{Path(sys.argv[0]).name}: error: {e}")


def command_line() -> str:
    """How this bench was invoked, as a shell line that reruns it (arguments with spaces quoted)."""
    script = Path(sys.argv[0]).resolve()
    repo = Path(__file__).resolve().parents[1]
    where = script.relative_to(repo) if script.is_relative_to(repo) else Path("bench", script.name)
    return f"python {where} {shlex.join(sys.argv[1:])}".rstrip()


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux) with its family and model numbers (a virtual machine may name
    every generation "AMD EPYC": family 25 model 1 is Zen 3, model 17 Zen 4), else platform's processor name."""
    info = Path("/proc/cpuinfo")
    fields = {}
    for line in info.read_text().splitlines() if info.exists() else []:
        key, _, value = line.partition(":")
        if not key.strip() and fields:  # the first processor's block has ended
            break
        fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    family = f" (family {fields['cpu family']}, model {fields['model']})" if "cpu family" in fields else ""
    return fields["model name"] + family


def loadavg() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def machine() -> dict:
    """What a reader needs to compare runs: CPU, cores, torch threads, library versions, and the kernel path forced by
    $BITQUILT_ISA where it is set."""
    import transformers

    forced = {"BITQUILT_ISA": os.environ["BITQUILT_ISA"]} if os.environ.get("BITQUILT_ISA") else {}
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], **forced}


def add_quant_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of a timed quantization run (bench/quant_time.py, bench/quant_profile.py): model, method,
    calibration windows of 512 tokens, threads."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="awq+gptq")
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so a killed run never leaves half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fmt_ppl(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:,.0f}" if x >= 1000 else f"{x:.2f}"


def pivot(corner: str, rows: list[str], cols: list[str], cell: dict[tuple[str, str], str]) -> list[str]:
    """A markdown table with one row per `rows` entry and one column per `cols` entry; missing cells blank."""
    return ([f"| {corner} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            + [f"| {r} | " + " | ".join(cell.get((r, c), "") for c in cols) + " |" for r in rows])


def by_setting(records: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """Records grouped by (model, measurement settings), in first-seen order."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(json.dumps([r["model"], r["settings"]], sort_keys=True), []).append(r)
    return [(*json.loads(key), rows) for key, rows in groups.items()]


def machines_line(rows: list[dict]) -> str:
    """The machine the rows ran on; a field that differs between rows (runs are appended over
    several sessions, e.g. with other thread counts) is listed with the number of rows per value."""
    fields = dict.fromkeys(k for r in rows for k in r["machine"])
    counts = {k: Counter(str(r["machine"].get(k)) for r in rows) for k in fields}
    same = {k: rows[0]["machine"].get(k) for k, c in counts.items() if len(c) == 1}
    varying = "".join(f"; {k}: " + ", ".join(f"{v} ({n} rows)" for v, n in c.items())
                      for k, c in counts.items() if len(c) > 1)
    return f"Machine: {same}{varying}."


def provenance(rows: list[dict]) -> list[str]:
    """A report's closing lines: the machine the rows ran on and every command that contributed some."""
    commands = dict.fromkeys(r["command"] for r in rows)
    return ["", machines_line(rows) + " Command(s): " + ", ".join(f"`{c}`" for c in commands), ""]


def setting_header(model: str, settings: dict, rows: list[dict]) -> list[str]:
    """Markdown section heading stating calibration (none where the settings hold none), evaluation, machine and the
    commands that ran."""
    c = settings.get("calibration")
    commands = ", ".join(f"`{cmd}`" for cmd in dict.fromkeys(r["command"] for r in rows))
    calibration = (f"Calibration: {c['n_samples']} × {c['seqlen']} tokens of `{c['source']}` (seed {c['seed']})"
                   if c else "No calibration")
    precision = (f", its matrix products in {settings['eval_precision']} (fp32 sums)"
                 if settings.get("eval_precision") else "")
    return [f"## {model}", "",
            f"{calibration}; evaluation: first {settings['ppl_windows']} windows × {settings['seqlen']} tokens of "
            f"`{settings['ppl_data']}`{precision}. {machines_line(rows)}", "",
            f"Command(s): {commands}", ""]


def sections(records: list[dict]) -> list[tuple[str, dict, list[dict], list[str]]]:
    """A perplexity report's sections: (model, settings, rows, the section's heading lines) per `by_setting` group."""
    return [(model, settings, rows, setting_header(model, settings, rows))
            for model, settings, rows in by_setting(records)]


def load_records(name: str) -> list[dict]:
    """The records in results/NAME.json (empty if it does not exist yet)."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text())["records"] if path.exists() else []


def record_key(record: dict, fields: tuple[str, ...]) -> tuple:
    """What identifies a measurement: the given fields plus the protocol settings."""
    return (*(record[f] for f in fields), json.dumps(record["settings"], sort_keys=True))


def measured(name: str, fields: tuple[str, ...]) -> set[tuple]:
    """Keys already in results/NAME.json (re-read each call: other runs may be appending)."""
    return {record_key(r, fields) for r in load_records(name)}


def append_record(name: str, record: dict, fields: tuple[str, ...]) -> list[dict]:
    """Add one record to results/NAME.json, replacing one with the same key; the read-modify-write
    holds a lock so concurrent runs don't drop each other's records. Returns all records."""
    with open(RESULTS / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key = record_key(record, fields)
        records = [r for r in load_records(name) if record_key(r, fields) != key] + [record]
        write_atomic(RESULTS / f"{name}.json", json.dumps({"records": records}, indent=1))
    return records


def stored_record(name: str, record: dict, fields: tuple[str, ...]) -> dict | None:
    """The record of results/NAME.json with the same key as `record`, if any."""
    key = record_key(record, fields)
    return next((r for r in load_records(name) if record_key(r, fields) == key), None)


def _rel_diff(r: dict) -> str:
    return "" if r["stored_ppl"] is None else f"{abs(r['new_ppl'] - r['stored_ppl']) / r['stored_ppl']:.1e}"


def recheck(name: str, record: dict, fields: tuple[str, ...]) -> None:
    """Measure-again mode (`--recheck`): compare a fresh record's perplexity with the stored one of the
    same key and log both in results/recheck.json / recheck.md, leaving results/NAME.json untouched.
    What a refactor must prove: every figure it did not mean to change is reproduced exactly."""
    stored = stored_record(name, record, fields)
    config = ", ".join(f"{f}={record[f]}" for f in fields)
    entry = {"bench": name, "config": config, "stored_ppl": stored["ppl"] if stored else None,
             "new_ppl": record["ppl"], "identical": stored is not None and stored["ppl"] == record["ppl"],
             "settings": record["settings"], "machine": record["machine"], "command": record["command"]}
    print(f"recheck {name}: stored {entry['stored_ppl']} new {entry['new_ppl']} identical {entry['identical']}")
    records = append_record("recheck", entry, ("bench", "config"))
    lines = ["# Recheck: stored benchmark figures measured again", "",
             "Generated by the `--recheck` option of `bench/accuracy.py` and `bench/w4a4.py`: each row is a "
             "configuration measured again with the current code and compared with the figure stored in its "
             "results file (exact float equality, and the relative difference: reductions in another thread "
             "count or library build change the last digits even of the untouched FP model).", "",
             "| bench | configuration | stored ppl | new ppl | identical | relative difference | command |",
             "|---|---|---:|---:|---|---:|---|"]
    for r in records:
        lines.append(f"| {r['bench']} | {r['config']} | {fmt_ppl(r['stored_ppl'])} | {fmt_ppl(r['new_ppl'])} | "
                     f"{'yes' if r['identical'] else 'no'} | {_rel_diff(r)} | `{r['command']}` |")
    write_atomic(RESULTS / "recheck.md", "\n".join(lines) + "\n")


def store(name: str, record: dict, fields: tuple[str, ...], render: Callable[[list[dict]], str],
          again: bool) -> None:
    """Keep a measured record: appended to results/NAME.json with NAME.md re-rendered, or (`again`,
    the --recheck mode) compared with the stored one in results/recheck.md."""
    if again:
        recheck(name, record, fields)
    else:
        write_atomic(RESULTS / f"{name}.md", render(append_record(name, record, fields)))


def add_protocol_args(p: argparse.ArgumentParser, calib_samples: int, ppl_windows: int) -> None:
    """Calibration and perplexity-evaluation options shared by the perplexity benchmarks."""
    p.add_argument("--calib-data", default="sciq")
    p.add_argument("--calib-samples", type=int, default=calib_samples)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--ppl-data", default="wiki")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--ppl-windows", type=int, default=ppl_windows)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--recheck", action="store_true",
                   help="measure stored configurations again and log old vs new in results/recheck.md")


def protocol_settings(args: argparse.Namespace) -> tuple[CalibConfig, dict]:
    """The calibration config (seed 0) and the settings dict every record stores and is keyed by; sets
    the torch thread count if --threads was given."""
    from bitquilt.recipes import CalibConfig  # not at the top: a runtime benchmark's child imports no calibration code

    if args.threads:
        torch.set_num_threads(args.threads)
    calib = CalibConfig(args.calib_data, args.calib_samples, args.calib_seqlen, 0)
    return calib, {"calibration": vars(calib), "ppl_data": args.ppl_data, "seqlen": args.seqlen,
                   "ppl_windows": args.ppl_windows}


# ---------------------------------------------------------------- one bench: arguments, results file, run facts
def parser(doc: str, *, model: str | None = None, models: str | None = None, threads: int | None | bool = False,
           workdir: str | None = None, helps: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """A bench's argument parser: its description the docstring's first paragraph, and the argument groups the
    benches share where asked for: --model (one packaged model or saved directory, default `model`), --models
    (comma-separated, default `models`), --threads (torch threads, default `threads`; None: torch's own) and
    --workdir (where saved models and exports go, default `workdir`); `helps` words a group's help for this bench."""
    helps = {"models": "comma-separated models", "workdir": "saved models and exports",
             "threads": f"torch threads (default: {'torch' + chr(39) + 's' if threads is None else threads})",
             **(helps or {})}
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if model is not None:
        p.add_argument("--model", default=model)
    if models is not None:
        p.add_argument("--models", default=models, help=helps["models"])
    if threads is not False:
        p.add_argument("--threads", type=int, default=threads, help=helps["threads"])
    if workdir is not None:
        p.add_argument("--workdir", default=workdir, help=helps["workdir"])
    return p


def doc_protocol(doc: str) -> str:
    """The paragraphs of a bench's docstring after its title and command, as one line: the protocol its report
    states."""
    return " ".join(doc.split("\n\n", 2)[2].split())


def checkout_args(p: argparse.ArgumentParser, report: str, rounds: int) -> None:
    """The arguments of a bench that runs a saved model by two or more checkouts of bitquilt, alternating."""
    p.add_argument("model", help="a directory saved by `bitquilt quantize`")
    p.add_argument("builds", nargs="+", help="name=<source tree>:<cache directory> (each checkout its own cache, so "
                   "their compiled kernels do not overwrite each other)")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--report", default=report, help="name of the report under bench/results/")


def write_report(name: str, record: dict, render: Callable[[dict], str]) -> None:
    """A one-shot report: `record` as results/NAME.json, its rendering as results/NAME.md, printed too."""
    write_atomic(RESULTS / f"{name}.json", json.dumps(record, indent=1))
    write_atomic(RESULTS / f"{name}.md", render(record))
    print(render(record))


def intro(title: str, text: str) -> list[str]:
    """A report's opening lines: `# title`, then each paragraph of the text block `text` on a line of its own."""
    lines = [f"# {title}", ""]
    for paragraph in text.strip().split("\n\n"):
        lines += [" ".join(paragraph.split()), ""]
    return lines


def stamp() -> dict:
    """The run facts every record ends with: the machine it ran on and the command that ran."""
    return {"machine": machine(), "command": command_line()}


class Bench:
    """One bench's results file, bench/results/NAME.{json,md}: records keyed by `key` (+ their settings), the report
    `render` makes of them, and the --recheck mode (`again`: measure stored keys again, compare, keep nothing)."""

    def __init__(self, name: str, key: tuple[str, ...], render: Callable[[list[dict]], str], again: bool = False):
        self.name, self.key, self.render, self.again = name, key, render, again

    def records(self) -> list[dict]:
        return load_records(self.name)

    def stored(self, wanted: dict) -> dict | None:
        """The stored record with the key of `wanted` (re-read each call: other runs may be appending)."""
        return stored_record(self.name, wanted, self.key)

    def todo(self, wanted: dict) -> bool:
        """Whether to measure `wanted`: it is not stored yet, or (--recheck) it is."""
        return (record_key(wanted, self.key) in measured(self.name, self.key)) == self.again

    def store(self, record: dict) -> None:
        """Keep `record` (NAME.md re-rendered), or in the --recheck mode compare it with the stored one."""
        store(self.name, record, self.key, self.render, self.again)

    def rerender(self) -> None:
        """Rewrite NAME.md from NAME.json."""
        write_atomic(RESULTS / f"{self.name}.md", self.render(self.records()))


def ppl_bench(p: argparse.ArgumentParser, name: str, key: tuple[str, ...], render: Callable[[list[dict]], str], *,
              calib_samples: int, ppl_windows: int) -> tuple[argparse.Namespace, CalibConfig, dict, Bench]:
    """A perplexity bench's start: the protocol options added to `p` and parsed, the calibration config and settings
    (`protocol_settings`) and its results file, in the --recheck mode where asked."""
    add_protocol_args(p, calib_samples, ppl_windows)
    args = p.parse_args()
    calib, settings = protocol_settings(args)
    return args, calib, settings, Bench(name, key, render, args.recheck)


@dataclass
class Child:
    """A finished child process: exit status, output, wall seconds start to exit, and its own CPU seconds (user +
    system) and peak RSS (ru_maxrss from wait4, not this process's)."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    peak_rss_mb: float


def run_child(argv: list[str], env: dict | None = None) -> Child:
    """Run `argv` to its exit and measure it (stderr goes through a file, so neither pipe can fill and stall it)."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err)
        stdout = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
        child.stdout.close()
        child.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read()
    return Child(child.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"), wall,
                 usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def run_facts() -> dict:
    """What a one-shot report's header states, taken at the start of a run: command, machine, load average, date
    (`finish` adds the load average at the end)."""
    return {"command": command_line(), "machine": machine(), "loadavg_start": loadavg(),
            "date": time.strftime("%Y-%m-%d")}


def finish(facts: dict) -> dict:
    facts["loadavg_end"] = loadavg()
    return facts


def run_header(facts: dict) -> str:
    """A one-shot report's header line from `run_facts` (a fact an older record lacks is left out)."""
    parts = [f"Command: `{facts['command']}`.", f"Machine: {facts['machine']}."]
    if "loadavg_start" in facts:
        parts.append(f"Load average {facts['loadavg_start']} at the start, {facts.get('loadavg_end', '?')} at the end.")
    if "date" in facts:
        parts.append(f"Date: {facts['date']}.")
    return " ".join(parts)
