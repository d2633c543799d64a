"""The rendezvous a launched job's rank 0 serves (MASTER_PORT): its port checked before any work, and the ranks gathered
in Python before the process group starts (``gather``). No DeepSpeed here, so the plan can ask (``zero/dist.py`` starts the
process group itself)."""
from __future__ import annotations

import errno
import os
import socket
import time
from typing import Any

from elsa_ds import launch_env
from elsa_ds.errors import ElsaError


def port_in_use(port: str) -> str:
    return (f"the rendezvous port {port} is in use on this machine (another job's: two `deepspeed` commands both take "
            "29500 unless told otherwise); start this one on a free port: deepspeed --master_port N ...")


def check_rendezvous_port() -> None:
    """ElsaError when the port rank 0 of a launched job will serve the rendezvous on (MASTER_PORT) is taken: said before
    the plan's checks and the warm start, not when the process group starts after them. Rank 0 alone checks, and not
    under torchrun's agent, whose own store already listens there (TORCHELASTIC_USE_AGENT_STORE), nor for a second job of
    a process whose group is up (its own store holds the port)."""
    import torch.distributed as dist

    port = os.environ.get("MASTER_PORT", "")
    launched = "RANK" in os.environ and launch_env.writes()
    if not launched or not port.isdigit() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    if dist.is_available() and dist.is_initialized():
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: a closed job's TIME_WAIT is no clash
        try:
            s.bind(("", int(port)))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ElsaError(port_in_use(port)) from None


ARRIVED_KEY = "elsa_ds/rendezvous/arrived"
POLL_S = 0.1
CONNECT_TRY_S = 2.0  # one try at reaching rank 0's port: the longest a signal waits while a rank looks for it


def gather(timeout_s: float) -> Any:
    """Wait, in Python, until every rank of a launched job has reached rank 0's store (MASTER_ADDR:MASTER_PORT), before
    the process group starts. torch's own rendezvous waits in C++, where Python's signal handlers do not run: a rank
    whose peers never came (a node that failed to start, a WORLD_SIZE too large) sat through Ctrl-C and the launcher's
    SIGTERM until DeepSpeed's timeout, 10 minutes (a walk, 2026-12-07). Here a rank looks for the store in tries of
    ``CONNECT_TRY_S`` and counts arrivals every ``POLL_S``, so a signal ends it within seconds, with the job's own
    cleanup; past ``timeout_s`` it ends in one line saying how many ranks came. Rank 0 serves the store multi-tenant, so
    torch's rendezvous then shares its server and port (and finds every rank there at once). Returns rank 0's store, to
    be kept until the process group is up; None where there is nothing to wait for: one rank, a group already up, or
    torchrun's agent store (the agent's rendezvous has already gathered the ranks)."""
    import torch.distributed as dist

    world, rank = launch_env.world_size(), launch_env.rank()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if world <= 1 or not addr or not port.isdigit() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    if dist.is_available() and dist.is_initialized():
        return None
    deadline = time.monotonic() + timeout_s
    store = _serve(addr, int(port), world, timeout_s) if rank == 0 else _reach(addr, int(port), world, rank, timeout_s)
    store.add(ARRIVED_KEY, 1)
    while (arrived := store.add(ARRIVED_KEY, 0)) < world:
        if time.monotonic() > deadline:
            raise ElsaError(f"the rendezvous at {addr}:{port}: {arrived} of {world} ranks arrived in {timeout_s:.0f} s "
                            "(DeepSpeed's timeout, DEEPSPEED_TIMEOUT minutes): a rank did not start, or started with "
                            "another MASTER_ADDR, MASTER_PORT or WORLD_SIZE; its node's launcher output says which")
        time.sleep(POLL_S)
    return store if rank == 0 else None


def _serve(addr: str, port: int, world: int, timeout_s: float) -> Any:
    """Rank 0's store, listening at once (its server shared with torch's rendezvous, which binds the same port)."""
    import datetime

    import torch.distributed as dist

    try:
        return dist.TCPStore(addr, port, world, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                             multi_tenant=True, use_libuv=os.environ.get("USE_LIBUV", "1") == "1")  # torch's reading of it
    except RuntimeError as err:
        if "EADDRINUSE" in str(err) or "address already in use" in str(err).lower():
            raise ElsaError(port_in_use(str(port))) from None
        raise


def _reach(addr: str, port: int, world: int, rank: int, timeout_s: float) -> Any:
    """A client of rank 0's store, once a plain socket finds it listening (tried every ``POLL_S``, ``CONNECT_TRY_S`` at most
    each: rank 0 may start later; torch's own tries log a C++ stack each)."""
    import datetime

    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(CONNECT_TRY_S, deadline - time.monotonic()))):
                break
        except OSError:  # nobody listens there yet (refused, unreachable, not resolved yet, timed out)
            if time.monotonic() >= deadline:
                raise ElsaError(f"rank {rank} could not reach the rendezvous at {addr}:{port} (rank 0's) in {timeout_s:.0f} "
                                "s (DeepSpeed's timeout, DEEPSPEED_TIMEOUT minutes): rank 0 did not start, or MASTER_ADDR and "
                                "MASTER_PORT name another machine or port; rank 0's launcher output says which") from None
            time.sleep(POLL_S)
    left = max(1.0, deadline - time.monotonic())
    return dist.TCPStore(addr, port, world, False, timeout=datetime.timedelta(seconds=left), wait_for_workers=False)
