"""Process resources: peak resident memory and what of a mapped file is resident, for reports and benchmarks (no
torch: the standalone runtime reports them too)."""

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


def resident_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of the file `path` (Linux /proc/self/smaps; 0 elsewhere): what of
    a mapped model is still in memory."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return 0
    total, inside, name = 0, False, str(Path(path).resolve())
    for line in smaps.read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
            inside = head[-1] == name
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total
