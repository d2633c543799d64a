"""The `deepspeed` command above a job's launcher, for the watchdog (``watchdog.py``): ranks left running when it alone ends.

On one node the command a user types, ``deepspeed launch/prune.py ...`` (DeepSpeed's ``launcher/runner.py``), starts
``python -m deepspeed.launcher.launch``, which starts the ranks, and waits for it. A SIGTERM or SIGKILL sent to that
command alone (``kill PID`` of the process the user started, a tool that stops only its own child) ends it without a
word to the launcher below, whose ranks train on unseen: the terminal's prompt is back, the output stays locked, and a
requeued or repeated run is refused by the lock of a job the user believes stopped. A stop of the process group (Ctrl-C,
``kill -- -PGID``, a scheduler's stop) reaches the launcher too: it then stops the ranks itself.

So the watchdog notes the runner above the launcher as the watch begins; once the launcher has been handed to another
parent, it waits for proof that the ranks go on (rank 0 marks another phase: a training step) or for the time the
launcher gives its ranks to stop after its own SIGTERM (``ORPHAN_WAIT_S``), then sends the launcher the SIGTERM the
process group would have: it stops the ranks, whose own handlers say so and clean up (exit 143; ``--resume``
continues from the last checkpoint). Stdlib and psutil only.
"""
from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

import psutil

ORPHAN_WAIT_S = 40.0  # deepspeed's launch.py gives its ranks 30 s after its own SIGTERM, then kills them and exits
RUNNERS = ("deepspeed", "ds")  # the console scripts that run deepspeed.launcher.runner


@dataclass
class Runner:
    """The runner above the launcher as the watch began (each a psutil.Process: its start time tells a reused pid
    apart), and what the watchdog has seen of its end."""
    proc: psutil.Process
    launcher: psutil.Process
    gone_at: float | None = None  # when the launcher was first seen without it (time.monotonic)
    marks_then: int = 0           # rank 0's phase marks counted by then
    stopped: bool = False         # the launcher was sent its SIGTERM


def is_runner(cmdline: list[str]) -> bool:
    """Whether a command line is deepspeed's runner: ``python -m deepspeed.launcher.runner``, or its console script
    (``deepspeed`` or ``ds``) run directly or as an interpreter's script (its first argument not an option)."""
    if "deepspeed.launcher.runner" in cmdline[:4]:
        return True
    script = cmdline[0] if cmdline and os.path.basename(cmdline[0]) in RUNNERS else \
        next((a for a in cmdline[1:] if not a.startswith("-")), "")
    return os.path.basename(script) in RUNNERS


def find_runner(launcher: int) -> Runner | None:
    """The runner that started ``launcher`` (deepspeed's launch.py) on this node, or None: another launcher (torchrun, a
    scheduler's srun), pdsh's remote shell on the other nodes of a multi-node job (there the runner stops them itself)."""
    if not launcher:
        return None
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(launcher)
        parent = proc.parent()
        if parent is not None and "deepspeed.launcher.launch" in proc.cmdline() and is_runner(parent.cmdline()):
            return Runner(parent, proc)
    return None


def orphaned(r: Runner, marks: int, now: float) -> bool:
    """Whether the launcher's ranks go on though the runner has ended: the launcher (the very process, not a reused
    pid) has another parent, and since it was first seen so rank 0 has marked a phase (``marks``: its marks so far) or
    ORPHAN_WAIT_S have passed. (A stop of the whole process group ends the runner too; its ranks then mark nothing more
    and the launcher exits within its own 30 s.)"""
    if r.stopped:
        return False
    try:
        if not r.launcher.is_running() or (r.proc.is_running() and r.launcher.ppid() == r.proc.pid):
            return False  # the launcher has ended (its ranks are stopped or about to be), or the runner is there
    except psutil.Error:
        return False
    if r.gone_at is None:
        r.gone_at, r.marks_then = now, marks
        return False
    return marks > r.marks_then or now - r.gone_at >= ORPHAN_WAIT_S


def stop_launcher(r: Runner) -> str:
    """Send the launcher the SIGTERM a stop of the process group would have sent it; what to tell the user."""
    r.stopped = True
    try:
        r.launcher.send_signal(signal.SIGTERM)  # psutil checks it is still the process found (not a reused pid)
    except psutil.Error as err:
        return (f"elsa_ds: error: the deepspeed command (pid {r.proc.pid}) has ended, but its launcher (pid "
                f"{r.launcher.pid}) could not be stopped ({err}): its ranks may still be running; stop them with "
                f"kill -TERM {r.launcher.pid}")
    return (f"elsa_ds: the deepspeed command (pid {r.proc.pid}) has ended while its ranks went on (a signal sent to it "
            "alone reaches none of them): they are stopped now, as a stop of the job's process group stops them (--resume "
            "continues from its last checkpoint, if it saved one)")
