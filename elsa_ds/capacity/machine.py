"""Can this machine run the job's ops? Checks of the host, made before any weight is loaded.

Beside ``preflight.py`` (will the job fit this machine's memory and disks): here the CPU's bf16 matmul, DeepSpeed's
async_io op for NVMe offload, the folders the engine writes outside the output (torch's JIT builds, the CPU backend's
/dev/shm), and torch's JIT extension builds that a killed build leaves locked. Each returns what to tell the user (or
changes the engine's config and says so); the job decides whether it stops.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from elsa_ds import launch_env, torch_api
from elsa_ds.admm.kernels.build_lock import extensions_root
from elsa_ds.files.disk_room import existing_ancestor
from elsa_ds.zero.engine import model_dtype


def job_device() -> str:
    """Where the job's ranks compute: "cpu" under DeepSpeed's CPU accelerator (also a CUDA box's with
    DS_ACCELERATOR=cpu), else "cuda"."""
    from deepspeed.accelerator import get_accelerator

    return "cpu" if get_accelerator().device_name() == "cpu" else "cuda"


def cpu_bf16_fallback(ds: dict) -> str | None:
    """On a CPU with no fast bf16 matmul, switch the engine's bf16 off (in place) and say so; None when nothing changed.

    torch runs CPU bf16 matmuls through oneDNN only where it supports them (AVX-512 or AMX); elsewhere (an AVX2 CPU
    such as AMD Zen 2/3) it takes a reference loop, measured 50x slower than fp32 (2048x256 @ 256x1024: 992 vs 19 ms),
    so a "bf16" run there is an fp32 run made slow. The weights, optimizer and ADMM states are fp32 either way; only
    the forward/backward precision changes. ``ELSA_DS_CPU_BF16=1`` keeps bf16."""
    from deepspeed.accelerator import get_accelerator

    if model_dtype(ds) is not torch.bfloat16 or get_accelerator().device_name() != "cpu":
        return None
    if os.environ.get("ELSA_DS_CPU_BF16", "0").strip() == "1" or torch_api.cpu_bf16_matmul_is_fast():
        return None
    ds["bf16"]["enabled"] = False
    return ("this CPU has no fast bf16 matmul (oneDNN bf16 needs AVX-512 or AMX; torch would take a loop ~50x "
            "slower than fp32): forward/backward run in fp32 instead of bf16. ELSA_DS_CPU_BF16=1 keeps bf16.")


def nvme_unavailable() -> str | None:
    """Why DeepSpeed's async_io op (NVMe offload) cannot be built on this machine, or None when it can. Without
    libaio the engine would fail only after the model is loaded and partitioned, with "Unable to JIT load the
    async_io op"."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    temp = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())  # where DeepSpeed compiles its test for libaio (an
    # audit: a full TMPDIR); TMPDIR as set, where Python would fall back from it to /tmp
    why = unwritable(temp)
    if why is None and (free := shutil.disk_usage(temp).free) < TEST_BUILD_ROOM:
        why = f"{temp} has {free:,} bytes free"
    if why:
        return (f"NVMe offload needs DeepSpeed's async_io op, whose check for libaio compiles a test program in the temporary "
                f"folder, but {why}: free space there or set TMPDIR to another folder")
    return ("NVMe offload needs DeepSpeed's async_io op, which cannot be built here (libaio and its headers were not "
            "found): install them (Debian/Ubuntu: apt-get install libaio-dev; RHEL/Fedora: dnf install libaio-devel), "
            "or use a config without NVMe offload such as ds_configs/zero3_offload.json")


def this_gpu() -> tuple[str, float] | None:
    """This machine's first CUDA GPU as (name, the bytes CUDA reports it holds), or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return f"this machine's GPU ({props.name})", float(props.total_memory)


SHM = "/dev/shm"
TEST_BUILD_ROOM = 16 * 2**20  # what a compile of a test program may take in TMPDIR, with room to spare


def host_folders_problem(world_size: int, cpu_ranks: bool) -> str | None:
    """Why the engine could not write where it writes outside the output, or None: the folder torch makes DeepSpeed's
    JIT-built ops in (unless DeepSpeed was installed with its ops built: elsa_ds's own fall back to torch without it)
    and, where DeepSpeed's CPU backend shares its all-reduce buffers (several ranks, all on this node), /dev/shm. An
    audit (OS limits, 2026-12-07): an unwritable build folder (HOME=/ in a container started with --user) was a
    traceback from inside DeepSpeed's start; an unwritable /dev/shm hung both ranks, past SIGTERM."""
    if not _prebuilt_ops() and (why := unwritable(build_folder()) or _no_exec(build_folder())):
        return (f"torch builds DeepSpeed's C++ ops in {extensions_root()} (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), "
                f"but {why}: set TORCH_EXTENSIONS_DIR to a folder you can write (not mounted noexec), or fix the permissions there")
    return shm_problem(world_size if cpu_ranks and world_size == launch_env.local_size(world_size) else 1)


def shm_problem(cpu_ranks_here: int) -> str | None:
    """Why DeepSpeed's CPU backend could not share its all-reduce buffers through /dev/shm, which it does for several
    CPU ranks all on one node; None when it can, or does not."""
    if cpu_ranks_here > 1 and (why := unwritable(Path(SHM))):
        return (f"DeepSpeed's CPU backend shares each rank's all-reduce buffer (~66 MiB) through {SHM}, but {why}: make {SHM} "
                "writable (in a container, its default tmpfs or a larger --shm-size), or run one rank")
    return None


def build_folder() -> Path:
    """The folder torch makes each op's build folder in: TORCH_EXTENSIONS_DIR itself, else its default root's folder for
    this Python and device (torch.utils.cpp_extension's naming)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return extensions_root()
    device = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
              f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    return extensions_root() / f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{device}"


def _prebuilt_ops() -> bool:
    """Whether DeepSpeed was installed with its ops built (DS_BUILD_OPS=1): it then loads them from the package."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return any(installed_ops.values())


def _no_exec(folder: Path) -> str | None:
    """Why the ops built in ``folder`` could not be loaded, or None: its file system is mounted ``noexec`` (an audit, file
    systems, 2026-12-07: DeepSpeed's start failed with "failed to map segment from shared object")."""
    where = existing_ancestor(folder)
    try:
        noexec = bool(os.statvfs(where).f_flag & os.ST_NOEXEC)
    except OSError:
        return None
    return f"{where} is on a file system mounted noexec, from which a built op cannot be loaded" if noexec else None


def unwritable(folder: Path) -> str | None:
    """Why no file can be made in ``folder`` (where it does not exist yet, in the nearest folder above it, where it would
    be made), or None: a file made and removed there, so a read-only mount counts as it does for root."""
    where = existing_ancestor(folder)
    try:
        handle, name = tempfile.mkstemp(prefix=".elsa_ds_probe_", dir=where)
        os.close(handle)
        os.unlink(name)
    except OSError as err:
        return f"{where} cannot be written ({err.strerror or err})"
    return None
