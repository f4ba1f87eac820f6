"""Peak memory of this process on Linux, for the CPU benchmarks (torch has no CPU allocator
statistics to ask instead): RSS and its high-water mark from /proc/self/status, and the reset of
that mark through /proc/self/clear_refs.

glibc's malloc must return every freed block of MMAP_THRESHOLD bytes or more to the kernel for RSS
to follow the live tensors: a benchmark sets MALLOC_MMAP_THRESHOLD_ in the environment of the
processes it measures.
"""

from __future__ import annotations

MMAP_THRESHOLD = 128 * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM (peak RSS) to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    return _status_kb("VmHWM") * 1024
