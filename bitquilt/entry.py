"""The `bitquilt` command's entry point: `bitquilt.cli` where the quantization side is installed; where it is not (a
torch-free install, which has the standalone runtime's `bitquilt-run` and `bitquilt-native` only), one line naming the
extra that brings it, exit 2, before anything imports torch."""

from __future__ import annotations

import importlib.util
import sys

NEEDS_FULL = ("bitquilt: error: this install has the standalone runtime only (bitquilt-run, bitquilt-native); the "
              "bitquilt command needs torch and the rest of the quantization side: pip install 'bitquilt[full]'")


def main(argv: list[str] | None = None) -> int:
    if importlib.util.find_spec("torch") is None:
        print(NEEDS_FULL, file=sys.stderr)
        return 2
    from bitquilt.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
