"""The rendezvous port a launched job's rank 0 serves (MASTER_PORT), checked before any work: no DeepSpeed here, so the
plan can ask (``zero/dist.py`` starts the process group itself)."""
from __future__ import annotations

import errno
import os
import socket

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
