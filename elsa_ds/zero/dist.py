"""Starting and stopping the process group (gloo on CPU, NCCL on GPU) through DeepSpeed."""
from __future__ import annotations

import atexit
import contextlib
import os
import socket
from collections.abc import Iterator

from elsa_ds import launch_env
from elsa_ds.admm.kernels.build_lock import clear_stale_locks
from elsa_ds.errors import ElsaError
from elsa_ds.zero import compat
from elsa_ds.zero.rendezvous import gather, port_in_use


SINGLE_PROCESS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now, for a process group's rendezvous (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """Initialize torch.distributed through DeepSpeed; a plain ``python`` run is rank 0 of 1. Returns (rank, world)."""
    if "RANK" not in os.environ:
        port = free_port()
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import torch.distributed as dist

    compat.check_deepspeed_version()
    if not dist.is_initialized():
        clear_stale_locks()  # DeepSpeed's ops are built from here on (its CPU backend's shm comm first): none waits forever
        from deepspeed.constants import default_pg_timeout

        store = gather(default_pg_timeout.total_seconds())  # every rank here, or a signal's end within seconds
        try:
            deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False)
        except RuntimeError as err:  # rank 0 serves the rendezvous: a second `deepspeed` command on the same default port
            if "EADDRINUSE" not in str(err):  # failed here, and was reported as another rank's end (a walk, 2026-12-02)
                raise
            raise ElsaError(port_in_use(os.environ.get("MASTER_PORT", ""))) from None
        del store  # torch's own store shares its server now
        atexit.register(_remove_shm_buffers, _shm_buffers())  # a rank dead before the unlink: the others' exits remove it
        _unlink_shm_buffer(dist)
        atexit.register(teardown)
    return dist.get_rank(), dist.get_world_size()


def same_on_every_rank(text: str | None) -> bool:
    """Whether every rank of the process group that passed a ``text`` passed the same one (a digest of it, compared in
    one all-reduce; a rank passing None takes no part, its value below every digest). Collective."""
    import hashlib

    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return True
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big") if text is not None else None  # 56 bits
    pair = [digest, -digest] if digest is not None else [-(2**62), -(2**62)]  # int64 either way round
    extremes = _all_reduce_max(pair)  # the largest digest and minus the smallest
    return extremes[0] < 0 or extremes[0] == -extremes[1]


def every_rank(ok: bool) -> bool:
    """Whether every rank of the process group passed ``ok`` True: a rank whose part of a collective step failed says
    so here, where the others would wait for it in the step's next collective. Collective."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return ok
    return _all_reduce_max([0 if ok else 1])[0] == 0


@contextlib.contextmanager
def agreed(what: str) -> Iterator[None]:
    """Around a part of a job that can fail on one rank alone (rank 0's writes, each rank's own file), in place of the
    barrier after it: at its end the ranks agree whether every one got through. A rank whose part raised raises that
    after agreeing; the others raise an ElsaError naming ``what`` instead of waiting for it in the next collective (on
    one node until the launcher kills them, across nodes until the backend's timeout). That is for an exception: a
    signal (KeyboardInterrupt, a SIGTERM's) ends its rank as it would anywhere, and the others report the peer gone. A
    collective inside must be one that every rank gets through or leaves by the same error (e.g. a part that agrees
    itself). Collective."""
    try:
        yield
    except Exception:
        every_rank(False)
        raise
    if not every_rank(True):
        raise ElsaError(f"{what}: another rank failed (its line says why)")


def _all_reduce_max(values: list[int]) -> list[int]:
    """The ranks' elementwise maximum of ``values`` (int64), in one all-reduce on the backend's device. Collective."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    gloo = dist.get_backend() == "gloo"  # CPU tensors, whatever accelerator this machine has
    device = torch.device("cpu") if gloo else torch.device(get_accelerator().device_name(), launch_env.local_rank())
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


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
        os.unlink(shm_buffer_path(dist.get_rank()))
    except FileNotFoundError:
        pass


def _shm_buffers() -> dict[str, tuple[int, int]]:
    """Every local rank's /dev/shm all-reduce buffer of this job as it is now (DeepSpeed's start made and mapped them
    all): path -> (device, inode). Empty off DeepSpeed's CPU backend."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return {}
    first, found = launch_env.rank() - launch_env.local_rank(), {}
    for rank in range(first, first + launch_env.local_size(1)):
        with contextlib.suppress(OSError):
            st = os.stat(path := shm_buffer_path(rank))
            found[path] = (st.st_dev, st.st_ino)
    return found


def _remove_shm_buffers(buffers: dict[str, tuple[int, int]]) -> None:
    """The buffers ``_shm_buffers`` found that are still those files (none after a good start: each rank unlinks its own
    once all have mapped it; never another job's of the same name). An audit (OS limits, 2026-12-07): a rank that died
    between DeepSpeed's start and that unlink (an abort under a thread limit) left 66 MiB in /dev/shm at each try."""
    for path, (device, inode) in buffers.items():
        with contextlib.suppress(OSError):
            if (st := os.stat(path)).st_dev == device and st.st_ino == inode:
                os.unlink(path)


def teardown() -> None:
    """Destroy the process group: a local teardown, no collective; registered to run at interpreter exit.

    Without it gloo's threads could still be live when the interpreter exits, and a rank then occasionally
    died in std::terminate after its work was done. Not earlier: DeepSpeed caches its groups process-wide, so a
    second job in the same process (the Python API) needs the same process group.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def launcher_env_restored() -> Iterator[None]:
    """Undo, on the way out, the launcher variables a single-process run set for itself (``init_distributed``).

    A job run from Python in a process no launcher started must not leave RANK / MASTER_PORT behind: a subprocess
    started afterwards (another ``python launch/prune.py``) would inherit them, take itself for rank 0 of a launched
    group and try to listen on the port this process's group still holds. The group itself stays up for the next job.
    """
    with launch_env.environ_restored(SINGLE_PROCESS_ENV):
        yield


def shm_buffer_path(rank: int) -> str:
    """The /dev/shm file DeepSpeed's CPU shm all-reduce creates per rank (name format of csrc/cpu/comm/shm.cpp)."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    return os.path.join("/dev/shm", name)
