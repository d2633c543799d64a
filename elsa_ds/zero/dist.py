"""Starting and stopping the process group (gloo on CPU, NCCL on GPU) through DeepSpeed."""
from __future__ import annotations

import atexit
import os
import socket

from elsa_ds.zero import compat


def init_distributed() -> tuple[int, int]:
    """Initialize torch.distributed through DeepSpeed; a plain ``python`` run is rank 0 of 1. Returns (rank, world)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import torch.distributed as dist

    compat.check_deepspeed_version()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
        _unlink_shm_buffer(dist)
        atexit.register(teardown)
    return dist.get_rank(), dist.get_world_size()


def _unlink_shm_buffer(dist) -> None:
    """Remove this rank's /dev/shm all-reduce buffer of DeepSpeed's CPU backend once every rank has mapped it.

    DeepSpeed's shm_comm (CPU accelerator, all ranks on one node) creates a 66 MiB shared-memory file per rank
    and never unlinks it, so every run leaked that much of /dev/shm. Every rank maps every other rank's file
    inside init_distributed, so after a barrier the names are no longer needed: the mappings stay valid, and
    the memory is freed when the last rank exits, however it exits.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    dist.barrier()
    try:
        os.unlink(compat.shm_buffer_path(dist.get_rank()))
    except FileNotFoundError:
        pass


def teardown() -> None:
    """Destroy the process group: a local teardown, no collective; registered to run at interpreter exit.

    Without it gloo's threads could still be live when the interpreter exits, and a rank then occasionally
    died in std::terminate after its work was done. Not earlier: DeepSpeed caches its groups process-wide, so a
    second job in the same process (the Python API) needs the same process group.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
