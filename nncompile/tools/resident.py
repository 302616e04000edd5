"""This process's resident memory as the Linux kernel counts it (/proc/self/status): what a
memory check measures on CPU, where the allocator has no counters of its own.

    reset_peak()                      # the high-water mark := the resident set now
    run()
    added = status("VmHWM") - before  # the peak resident bytes run() added
"""
from __future__ import annotations


def status(field: str) -> int | None:
    """A /proc/self/status memory line (VmRSS, VmHWM) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak() -> None:
    """Reset VmHWM to the current VmRSS (writing 5 to /proc/self/clear_refs); a no-op where
    the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
