"""What /proc says of a process and of the machine, for the watchdog (``watchdog.py``) and the pre-flight check: a
process's state, start time and exit status, the out-of-memory killer's count, the cgroup's memory limit and room, the
CPUs a process may use, and a path's identity. Stdlib only, and the launcher's variables (``launch_env``)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from elsa_ds import launch_env


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state first, so the parent is [1], the start time [19]);
    None where /proc cannot show them."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def proc_stat(pid: int) -> tuple[str, str, int | None] | None:
    """(state, start time, exit status) of ``pid`` from /proc: the exit status of a zombie not yet reaped (Linux ≥ 3.5)."""
    if (fields := stat_fields(pid)) is None:
        return None
    return fields[0], fields[19], int(fields[49]) if len(fields) > 49 else None


def ancestors() -> set[int]:
    """The processes that started this one, up to the first /proc cannot show."""
    pids, pid = set(), os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int((stat_fields(pid) or [])[1])
        except (ValueError, IndexError):
            break
    return pids


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has ended since boot, cgroup limits included."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None


V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file"))  # limit, usage,
V2_FILES = ("memory.max", "memory.current", ("active_file", "inactive_file"))  # and the page cache the kernel reclaims


def _cgroup_dirs(controller: str, root: Path = Path("/")) -> list[tuple[Path, bool]]:
    """(folder, whether it is v1) of every level of this process's cgroup for ``controller`` (v1's "memory", "cpu"; v2's
    one tree), from its own up to the root. ``root``: tests read a copy."""
    dirs = []
    with contextlib.suppress(OSError, ValueError):
        for line in (root / "proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            v1 = controller in controllers.replace(",", " ").split()  # /proc/self/cgroup: "id:controllers:path"
            if not (v1 or not controllers):
                continue
            base = root / "sys/fs/cgroup" / (controllers if v1 else "")
            if v1 and not base.is_dir():  # v1 mounts "cpu,cpuacct" as that folder, often with "cpu" as a link to it
                base = root / "sys/fs/cgroup" / controller
            for d in (base / path.lstrip("/"), *(base / path.lstrip("/")).parents):
                dirs.append((d, v1))
                if d == base:
                    break
    return dirs


def _cgroup_levels(root: Path = Path("/")) -> list[tuple[int, int | None]]:
    """(limit, bytes it counts against that limit that cannot be reclaimed; None where unreadable) of every level of this
    process's memory cgroup with a limit, from its own up to the root (v1 or v2). ``root``: tests read a copy."""
    levels = []
    with contextlib.suppress(OSError, ValueError):
        for d, v1 in _cgroup_dirs("memory", root):
            limit_name, usage_name, cache_keys = V1_FILES if v1 else V2_FILES
            if (d / limit_name).is_file() and (value := (d / limit_name).read_text().strip()) != "max":
                levels.append((int(value), _unreclaimable(d, usage_name, cache_keys)))
    return levels


def usable_cpus(root: Path = Path("/")) -> float:
    """The CPUs this job may run on: the affinity (SLURM's --cpus-per-task, taskset) of this process, or under a launcher
    of several ranks of the launcher, which holds the allocation its ranks share (a rank bound to cores of its own,
    deepspeed's --bind_cores_to_rank, has a part of it); and its cgroup's CPU quota (a container's --cpus: cpu.max in v2,
    cpu.cfs_quota_us over cpu.cfs_period_us in v1), the smaller. The machine's count is os.cpu_count()'s."""
    launched = launch_env.launched()
    parent = os.getppid()
    try:  # a launcher that is gone left this process to init (pid 1) or a subreaper: its own affinity then
        counts: list[float] = [float(len(os.sched_getaffinity(parent if launched and parent > 1 else 0)))]
    except (AttributeError, OSError):  # no affinity on this system, or the launcher ended just now
        counts = [float(os.cpu_count() or 1)]
    for d, v1 in _cgroup_dirs("cpu", root):
        with contextlib.suppress(OSError, ValueError):
            quota, period = ((d / "cpu.cfs_quota_us").read_text(), (d / "cpu.cfs_period_us").read_text()) if v1 else \
                (d / "cpu.max").read_text().split()
            if quota.strip() not in ("max", "-1"):
                counts.append(int(quota) / int(period))
    return min(counts)


def _unreclaimable(folder: Path, usage_name: str, cache_keys: tuple[str, str]) -> int | None:
    """A cgroup's usage less its file page cache, active and inactive (the kernel reclaims it before it kills; shared
    memory is not in it); its whole usage when memory.stat cannot be read; None when the usage cannot."""
    try:
        usage = int((folder / usage_name).read_text().strip())
    except (OSError, ValueError):
        return None
    with contextlib.suppress(OSError, ValueError):
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
        return max(0, usage - sum(int(stat.get(key, 0)) for key in cache_keys))
    return usage


def cgroup_limit(root: Path = Path("/")) -> int | None:
    """The memory limit of this process's cgroup: the tightest memory.max (v2) or memory.limit_in_bytes (v1) up its tree."""
    limits = [limit for limit, _ in _cgroup_levels(root)]
    return min(limits) if limits else None


def cgroup_room(root: Path = Path("/")) -> tuple[int, int] | None:
    """(bytes this process's cgroup lets its processes take beyond what they and the rest of the cgroup hold now, the
    limit of the level that leaves least), or None without a limit. A level whose usage cannot be read counts as empty."""
    rooms = [(limit - (used or 0), limit) for limit, used in _cgroup_levels(root)]
    return min(rooms) if rooms else None


def path_state(path: Path) -> tuple | None:
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        return st.st_dev, st.st_ino, st.st_ctime_ns
    return None
