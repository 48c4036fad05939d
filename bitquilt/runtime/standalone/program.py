"""`bitquilt-native`: the native runner (csrc/runtime/native_runner.cpp), a program without Python built at install
time, run in place of this process, so that the process holds the runner, its tokenizer tables and the weights' pages
alone.

    bitquilt-native OUT_DIR --prompt "The capital of France is" --max-new-tokens 32 --threads 2
    bitquilt-native --path      # the compiled program itself, to copy where the export goes (no Python needed)

Options and output are bitquilt-run's (`bitquilt-native --help`); the export must carry tokenizer tables, which
`bitquilt export --to standalone` writes for byte-level BPE tokenizers (`bitquilt.export.tokenizer_tables`).
"""

from __future__ import annotations

import os
import sys

from bitquilt.errors import UserError
from bitquilt.runtime.standalone.library import runner_path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        runner = str(runner_path())
    except UserError as e:
        print(f"bitquilt-native: error: {e}", file=sys.stderr)
        return 2
    if argv == ["--path"]:
        print(runner)
        return 0
    sys.stdout.flush()
    try:
        os.execv(runner, [runner, *argv])  # does not return
    except OSError as e:
        print(f"bitquilt-native: error: cannot run {runner}: {e.strerror} (installed on a noexec mount?)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
