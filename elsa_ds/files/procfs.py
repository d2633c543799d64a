"""What /proc says of a process and of the machine, for the watchdog (``watchdog.py``): a process's state, start time
and exit status, the out-of-memory killer's count, the cgroup's memory limit, and a path's identity. Stdlib only."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def proc_stat(pid: int) -> tuple[str, str, int | None] | None:
    """(state, start time, exit status) of ``pid`` from /proc: the exit status of a zombie not yet reaped (Linux ≥ 3.5)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], fields[19], int(fields[49]) if len(fields) > 49 else None


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot, cgroup limits included."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None


def cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup: the tightest memory.max (v2) or memory.limit_in_bytes (v1) up its tree."""
    limits = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            v1 = "memory" in controllers.replace(",", " ").split()  # /proc/self/cgroup: "id:controllers:path"
            base, name = (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes") if v1 else (Path("/sys/fs/cgroup"), "memory.max")
            for d in (base / path.lstrip("/"), *(base / path.lstrip("/")).parents) if v1 or not controllers else ():
                if (d / name).is_file() and (value := (d / name).read_text().strip()) != "max":
                    limits.append(int(value))
                if d == base:
                    break
    return min(limits) if limits else None


def path_state(path: Path) -> tuple | None:
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        return st.st_dev, st.st_ino, st.st_ctime_ns
    return None
