"""Can this machine run the job's ops? Checks of the host, made before any weight is loaded.

Beside ``preflight.py`` (will the job fit this machine's memory and disks): here the CPU's bf16 matmul, DeepSpeed's
async_io op for NVMe offload, and torch's JIT extension builds that a killed build leaves locked. Each returns what
to tell the user (or changes the engine's config and says so); the job decides whether it stops.
"""
from __future__ import annotations

import os

import torch

from elsa_ds.zero import compat
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
    if os.environ.get("ELSA_DS_CPU_BF16", "0").strip() == "1" or compat.cpu_bf16_matmul_is_fast():
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
    return ("NVMe offload needs DeepSpeed's async_io op, which cannot be built here (libaio and its headers were not "
            "found): install them (Debian/Ubuntu: apt-get install libaio-dev; RHEL/Fedora: dnf install libaio-devel), "
            "or use a config without NVMe offload such as ds_configs/zero3_offload.json")


def this_gpu() -> tuple[str, float] | None:
    """This machine's first CUDA GPU as (name, the bytes CUDA reports it holds), or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return f"this machine's GPU ({props.name})", float(props.total_memory)
