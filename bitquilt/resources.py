"""Process resources: peak resident memory, for reports and benchmarks."""

from __future__ import annotations

import resource
from pathlib import Path


def reset_peak_rss() -> None:
    """Restart the peak-RSS counter (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """Peak resident memory since the last `reset_peak_rss` (or process start), in MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
