"""Markdown tables: the one table printer of the command line and the benchmark reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _is_number(s: str) -> bool:
    try:
        float(s.replace(",", ""))
    except ValueError:
        return False
    return True


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | dict[str, str]) -> str:
    """A GitHub markdown table of ``rows``; ``columns`` are row keys, or a {key: header} mapping.

    Missing values are blank, floats get 4 significant digits, numeric columns are right-aligned.
    """
    headers = dict(columns) if isinstance(columns, dict) else {c: c for c in columns}
    cells = [[cell(r.get(k)) for k in headers] for r in rows]
    right = [all(_is_number(row[i]) for row in cells if row[i]) and any(row[i] for row in cells)
             for i in range(len(headers))]
    lines = ["| " + " | ".join(cell(h) for h in headers.values()) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"
