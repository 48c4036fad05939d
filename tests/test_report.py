"""Comparison reports: markdown table, JSON, plots, atomic writes."""

from __future__ import annotations

import json

import pytest

from bitquilt.eval import report
from bitquilt.eval.report import write_report
from bitquilt.tables import markdown_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(method, bits, bpw, wiki, piqa, arc, **extra):
    return {"method": method, "w_bits": bits, "group_size": None if method == "fp" else 128,
            "ppl_wiki": wiki, "ppl_lambada": wiki * 2, "piqa/acc": piqa - 0.01, "piqa/acc_norm": piqa,
            "arc_easy/acc": arc, "arc_easy/acc_norm": arc + 0.02, "lambada/acc": 0.3, "lambada/perplexity": 40.0,
            "bits_per_weight": bpw, "size_mb": 540.0 * bpw / 32, **extra}


ROWS = [_row("fp", 16, 32.0, 20.5, 0.68, 0.60),
        _row("rtn", 4, 4.25, 25.0, 0.64, 0.55, quant_time_s=1.5),
        _row("rtn", 3, 3.25, 60.0, 0.58, 0.45, quant_time_s=1.4),
        _row("gptq", 4, 4.25, 22.0, 0.66, 0.58, quant_time_s=30.0),
        _row("gptq", 3, 3.25, 31.0, 0.62, 0.52, quant_time_s=29.0, label="gptq-3bit")]


def test_write_report_files(tmp_path):
    out = tmp_path / "rep"
    paths = write_report(ROWS, out, title="smollm2 comparison", settings={"model": "smollm2-135m", "limit": 200,
                                                                          "calibration": {"n_samples": 16}})
    assert [p.name for p in paths] == ["report.md", "report.json", "ppl_vs_bpw.png", "acc_vs_bpw.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths)  # no temporary files left
    for png in paths[2:]:
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert json.loads(paths[1].read_text()) == {"title": "smollm2 comparison", "rows": ROWS,
                                                "settings": {"model": "smollm2-135m", "limit": 200,
                                                             "calibration": {"n_samples": 16}}}
    md = paths[0].read_text()
    assert md.startswith("# smollm2 comparison\n")
    header = next(line for line in md.splitlines() if line.startswith("| Model"))
    assert header == ("| Model | W bits | Group | PPL wiki | PPL lambada | piqa acc_norm | arc_easy acc_norm | "
                      "lambada acc | lambada ppl | Avg acc | Size MB | Bits/w | Quant s |")
    # fp row: no bits/group; accuracies in %; avg = mean of primary metrics (acc_norm, acc_norm, acc)
    assert "| fp |  |  | 20.50 | 41.00 | 68.0 | 62.0 | 30.0 | 40.00 | 53.3 | 540.0 | 32.00 |  |" in md
    assert "| rtn w4 g128 | 4 | 128 | 25.00 |" in md and "| gptq-3bit | 3 | 128 | 31.00 |" in md
    assert "| limit | 200 |" in md and '| calibration | {"n_samples": 16} |' in md
    assert "![ppl_vs_bpw](ppl_vs_bpw.png)" in md


def test_files_are_replaced_atomically(tmp_path, monkeypatch):
    rows = [{"method": "rtn", "w_bits": 4, "ppl": 12.0}]  # no plots: keeps the test fast
    write_report(rows, tmp_path, title="first", settings={})
    before = (tmp_path / "report.json").read_text()

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report.json, "dumps", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(rows, tmp_path, title="second", settings={})
    assert (tmp_path / "report.json").read_text() == before  # the old file survives a failed write
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_rows_without_data_for_plots_give_markdown_and_json_only(tmp_path):
    rows = [{"method": "rtn", "w_bits": 4, "group_size": 64, "ppl": {"wiki": 12.0}}]
    paths = write_report(rows, tmp_path, title="t", settings={})
    assert [p.name for p in paths] == ["report.md", "report.json"]
    assert "| rtn w4 g64 | 4 | 64 | 12.00 |" in paths[0].read_text()


def test_markdown_table():
    rows = [{"name": "a|b", "x": 1.23456, "n": 3}, {"name": "c", "x": None, "n": 12345.0}]
    assert markdown_table(rows, {"name": "Name", "x": "X", "n": "N"}) == (
        "| Name | X | N |\n|---|---:|---:|\n| a\\|b | 1.235 | 3 |\n| c |  | 12,345 |\n")
    assert markdown_table(rows, ["n"]).splitlines()[0] == "| n |"


def test_pareto_front():
    pts = [(4.25, 22.0), (4.25, 25.0), (3.25, 31.0), (3.25, 60.0), (5.0, 23.0), (8.0, 20.0)]
    assert report._pareto(pts) == [(3.25, 31.0), (4.25, 22.0), (8.0, 20.0)]
