"""The watchdog of a job: one line, and the job's own cleanup, when a rank is killed outright.

A job's exit path removes its staging folder, side files and lock however it ends (``jobs/owner.py``), except when a
rank is killed by a signal no process can catch: SIGKILL, most often from the kernel's out-of-memory killer, after which
the deepspeed launcher says "exits with return code = -9" and nothing more. So rank 0 (the rank that writes), once it
owns the output, starts this small process (stdlib and psutil only):

    python -E -m elsa_ds.files.watchdog --pid RANK0 [--launcher PID --ranks N] --steps N --lock LOCK --clean PATH ...
        [--resumable PATH ... --output OUT]

It forks away at once into a session of its own: neither a kill of the job's process group nor the launcher's kill of
rank 0's process tree takes it. Through its stdin rank 0 tells it each phase it begins (``jobs/phases.py``, the stages
of ``jobs/interface.py``) and, last, that its exit path ran (success or a handled error). Twice a second it samples the
host memory and the job's resident memory, keeping the peaks. A rank that dies is seen at once (a pidfd), its exit
status read from /proc before the launcher, which polls each second, reaps it.

Rank 0 gone without its exit path: it removes what that path would have, only under the output's lock naming rank 0
and only what this job created or changed (but what a --resume reads again once the job published a checkpoint), then
says one line on the job's stderr after the launcher's: which rank, which signal, the phase, the memory peaks, and
whether the kernel's out-of-memory killer ran meanwhile (``oom_kill`` in ``/proc/vmstat``). Another rank killed, rank 0
then stopped by the launcher: the same line, rank 0 having cleaned up. A clean end: not a word. Only the ranks on rank
0's node are watched. What --overwrite set aside of the previous output it puts back (``aside.put_back``); a publication
cut short it completes (``aside.settle_old``: rank 0 announces it once its staging folder is the finished output).
The `deepspeed` command ended alone, its ranks going on (``runner.py``): it sends the launcher the SIGTERM a stop of the
process group would have, and says so.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elsa_ds import launch_env
from elsa_ds.errors import stderr_line
from elsa_ds.quoting import one_line
from elsa_ds.files.aside import PUBLICATIONS, PUBLISH_FAILED, Settled, published, put_back, settle_old, tags_begun
from elsa_ds.files.ownership import read_holder
from elsa_ds.files.procfs import cgroup_limit, oom_kills, path_state, proc_stat
from elsa_ds.files.runner import Runner, find_runner, orphaned, stop_launcher

GIB = 2**30
SAMPLE_S = 0.5
LAUNCHER_WAIT_S = 40.0  # deepspeed's launch.py gives the other ranks 30 s to stop after SIGTERM
LOCK_WAIT_S = 10.0  # a forked child of the dead rank 0 (a data loader worker) may hold its lock a few seconds more
STOPPED = (signal.SIGTERM, signal.SIGINT)  # the launcher's or a user's stop: the rank's own handlers say so
PHASES = {  # what each phase name rank 0 sends means to a user (anything else is shown as sent)
    "setup": "setup (checks, data, warm start, model, engine)", "load": "setup (checks, data, warm start, model, engine)",
    "load_checkpoint": "the checkpoint's load or the reference perplexities", "train": "the job's train stage",
    "finish": "the finish (validation, export, report)", "validation": "the validation of the pruned model",
    "export": "the export of the pruned model", "verify": "the report (the export read back)",
    "publish": "the output's publication", "publish_into": "the output's publication",
    PUBLISH_FAILED: "the exit after the output's publication failed",
    "done": "the evaluation after the output was published",
}
OOM_ADVICE = ("see what each phase needs with elsa-estimate (the job's flags) and choose a config that needs less host memory "
              "(ds_configs/zero3_offload_elsal.json: ELSA-L; ds_configs/zero3_nvme.json: NVMe offload)")


# ---- rank 0's side ----------------------------------------------------------------------------------------------------
class Watchdog:
    """Rank 0's end of the pipe to its watchdog; inactive (every call a no-op) until :meth:`start`."""

    def __init__(self) -> None:
        self.fd: int | None = None  # the pipe's write end, non-blocking: a full pipe drops a phase, never stalls a step

    def start(self, lock: Path, clean: list[Path], steps: int | None, resumable: list[Path] | None = None,
              output: Path | None = None) -> None:
        """Start the watchdog of this process's job (the ranks on this node), which removes ``clean`` (``resumable`` only
        while ``output`` has no published checkpoint) and ``lock``, and puts back what --overwrite set aside of ``output``,
        should the job be killed; one that cannot start is a warning only."""
        local = str(launch_env.local_size(1))
        launcher = os.getppid() if "LOCAL_RANK" in os.environ else 0  # deepspeed's launch.py, torchrun's agent
        paths = [("--clean", p) for p in clean] + [("--resumable", p) for p in resumable or []]
        paths += [("--output", output.resolve())] if output else []
        cmd = [sys.executable, "-E", "-m", "elsa_ds.files.watchdog", "--pid", str(os.getpid()), "--launcher", str(launcher),
               "--ranks", local, "--steps", str(steps or 0), "--lock", str(lock), *(a for f, p in paths for a in (f, str(p)))]
        read, write, proc = *os.pipe(), None
        code: int | str  # the first process's exit code, or why it did not run
        try:  # -E: none of the job's PYTHON* variables (a sitecustomize that imports torch); elsa_ds found from cwd
            proc = subprocess.Popen(cmd, stdin=read, stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2],
                                    start_new_session=True)
            code = proc.wait(timeout=120)  # the first process forks the watchdog off and returns once it is ready
        except (OSError, subprocess.TimeoutExpired) as err:
            code = str(err)
            if proc is not None:
                proc.kill()  # not forked yet: no watchdog that would take the job's normal end for a kill
        finally:
            os.close(read)
        if code != 0:
            os.close(write)
            from elsa_ds.log import get_logger

            get_logger(__name__).warning(f"the watchdog of a killed job did not start ({code}): a SIGKILL would leave "
                                         "this job's staging and lock beside the output")
            return
        os.set_blocking(write, False)
        self.fd = write

    def mark(self, phase: str, step: int | None = None) -> None:
        """The phase rank 0 begins (``step``: 0-based, for a training step)."""
        self._send({"phase": phase, "step": step})

    def end(self) -> None:
        """The job's exit path has run: the watchdog leaves without a word (unless a rank was killed meanwhile)."""
        if self.fd is not None:
            self._send({"ended": True}, wait=2.0)
            os.close(self.fd)
            self.fd = None

    def _send(self, message: dict, wait: float = 0.0) -> None:
        if self.fd is None:
            return
        data = (json.dumps(message) + "\n").encode()
        try:
            if not wait or select.select([], [self.fd], [], wait)[1]:
                os.write(self.fd, data)  # < PIPE_BUF: all or nothing; a full pipe raises BlockingIOError, the phase is lost
        except BlockingIOError:
            pass
        except OSError:  # the watchdog is gone
            os.close(self.fd)
            self.fd = None


# ---- the watchdog process -------------------------------------------------------------------------------------------
@dataclass
class Rank:
    rank: int
    pid: int
    start: str                       # its start time (/proc/PID/stat): tells a reused pid apart
    pidfd: int | None = None         # readable once it exits (Linux >= 5.3; else the ranks are polled)
    status: int | None = None        # its exit status (waitpid's form) once read; None while alive, or when unknown
    gone: bool = False


@dataclass
class Watch:
    """What the watchdog knows of the job: its ranks, the phase rank 0 reached, the memory peaks."""
    args: argparse.Namespace
    ranks: dict[int, Rank] = field(default_factory=dict)            # by pid
    poller: Any = field(default_factory=select.poll)                 # the ranks' pidfds and rank 0's pipe
    before: dict[str, tuple | None] = field(default_factory=dict)   # each path to clean as it was when the watch began
    phase: dict = field(default_factory=lambda: {"phase": "setup", "step": None})
    ended: bool = False
    killed: Rank | None = None       # the first rank that died of a signal (rank 0 vanished: rank 0)
    peak_used: int = 0
    peak_job: int = 0
    oom_before: int | None = None
    runner: Runner | None = None     # the deepspeed command above the launcher (files/runner.py): its end alone stops it
    marks: int = 0                   # rank 0's phase marks so far


def add_rank(w: Watch, pid: int, rank: int) -> None:
    stat = proc_stat(pid)
    if stat is None or pid in w.ranks:
        return
    r = w.ranks[pid] = Rank(rank, pid, stat[1])
    with contextlib.suppress(AttributeError, OSError):
        r.pidfd = os.pidfd_open(pid)
        w.poller.register(r.pidfd, select.POLLIN)


def discover(w: Watch) -> None:
    """The launcher's ranks on this node (its children with RANK set), until all ``--ranks`` are found."""
    if not w.args.launcher or len(w.ranks) >= w.args.ranks:
        return
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(w.args.launcher).children():
            with contextlib.suppress(psutil.Error, ValueError):
                env = child.environ()
                if "RANK" in env:
                    add_rank(w, child.pid, int(env["RANK"]))


def check_ranks(w: Watch) -> None:
    """Note each rank that has ended, with its exit status while still readable (a zombie the launcher has not reaped);
    the first to die of a signal other than a stop (SIGTERM, SIGINT: the rank's own handlers speak) is the one named."""
    for r in w.ranks.values():
        stat = None if r.gone else proc_stat(r.pid)
        if r.gone or (stat is not None and stat[1] == r.start and stat[0] not in "ZX"):
            continue
        r.gone = True
        r.status = stat[2] if stat is not None and stat[1] == r.start else None
        if r.pidfd is not None:
            w.poller.unregister(r.pidfd)
            os.close(r.pidfd)
        signum = (r.status or 0) & 0x7F
        if w.killed is None and signum and signum not in STOPPED:
            w.killed = r


def read_messages(w: Watch, fd: int, pending: bytearray) -> bool:
    """Rank 0's messages so far; False once its end of the pipe is closed."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        pending.extend(chunk)
        *lines, rest = pending.split(b"\n")
        pending[:] = rest
        for line in lines:
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                w.ended = w.ended or bool(message.get("ended"))
                if "phase" in message:
                    w.phase = message
                    w.marks += 1


def sample(w: Watch, root) -> None:
    """The host memory in use and the job's resident memory (its ranks and everything they started), as peaks."""
    vm = psutil.virtual_memory()
    w.peak_used = max(w.peak_used, vm.total - vm.available)
    with contextlib.suppress(psutil.Error):
        procs = ([] if w.args.launcher else [root]) + root.children(recursive=True)
        w.peak_job = max(w.peak_job, sum(p.memory_info().rss for p in procs))  # one gone meanwhile: the next sample


def watch(w: Watch, channel: int) -> None:
    """Until rank 0 ends by its exit path (a word only if a rank was killed meanwhile) or vanishes without it (its cleanup,
    then the line)."""
    root = psutil.Process(w.args.launcher or w.args.pid)
    os.set_blocking(channel, False)
    w.poller.register(channel, select.POLLIN)
    pending, listening, rank0 = bytearray(), True, w.ranks[w.args.pid]
    while True:
        sample(w, root)
        discover(w)
        fast = any(r.pidfd is None for r in w.ranks.values())  # then poll the ranks faster than the launcher reaps them
        w.poller.poll(1000 * (0.2 if fast else SAMPLE_S))
        check_ranks(w)
        if listening and not read_messages(w, channel, pending):
            w.poller.unregister(channel)
            listening = False
        if w.runner is not None and not w.ended and orphaned(w.runner, w.marks, time.monotonic()):
            with contextlib.suppress(OSError):  # then the ranks' own lines (terminated), and rank 0's exit path
                stderr_line("\n" + stop_launcher(w.runner))
        if w.ended:
            if w.killed is not None:
                say(w, "nothing unfinished was published (rank 0's exit path cleaned up)")
            return
        if rank0.gone:
            w.killed = w.killed or rank0
            say(w, cleanup(w))
            return


def cleanup(w: Watch) -> str:
    """Remove what rank 0's exit path would have: only while the output's lock still names rank 0 (held by nothing else
    once rank 0's descendants let it go), and only what changed since the watch began. Says what it did."""
    lock = Path(w.args.lock)
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return "nothing unfinished of it is left (its lock was already released)"
    try:
        holder = read_holder(fd)
        rank0 = w.ranks[w.args.pid]
        if holder.get("pid") != rank0.pid or holder.get("pid_start") not in (None, rank0.start):
            return f"its files beside the output are left as they are: the lock {lock} names another job now"
        deadline = time.monotonic() + LOCK_WAIT_S  # held on by a straggler of rank 0 past it: still no other job's
        while not flocked(fd) and time.monotonic() < deadline:
            time.sleep(0.2)
        output = Path(w.args.output) if w.args.output else None
        kind = str(w.phase.get("phase"))  # rank 0 says so just before its publication's first move (files/output.publish)
        settled = settle_old(output, rank0.pid, kind) if output and kind in (*PUBLICATIONS, PUBLISH_FAILED) else Settled(False)
        removed, resumable = 0, set(w.args.resumable) if output and published(output).exists() else set()
        for path, before in w.before.items():
            now = path_state(Path(path))
            if now is None or now == before or path in resumable or path == str(settled.kept):
                continue  # absent, there before this job and untouched by it, read again by a --resume, or the finished output
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed += 1
        back = put_back(output, rank0.pid, tags_begun(output)) if output else None  # --overwrite's (other ranks may write)
        left = "; ".join(filter(None, (settled.warning, back)))
        if (path_state(lock) or ())[:2] == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            lock.unlink()
        done = (f"its output {output} is published, whole (its summary was not printed)" if settled.published
                else "nothing was published" if settled.kept else "nothing unfinished was published")
        return (f"{done}; its lock and {removed} unfinished file{'s' * (removed != 1)} beside the output are removed"
                f"{'; ' + left if left else ''}")
    except (OSError, ValueError) as err:
        return f"its cleanup failed ({err}): remove this job's staging and lock beside the output by hand"
    finally:
        os.close(fd)


def flocked(fd: int) -> bool:
    """Whether the lock is taken now (a filesystem without flock: the holder it names decides)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def say(w: Watch, cleaned: str) -> None:
    """The one line, on the job's stderr, after the launcher's (it stops the other ranks, then says its own), on a line of
    its own (a progress bar may have ended without one)."""
    if w.args.launcher:
        with contextlib.suppress(psutil.Error):
            psutil.Process(w.args.launcher).wait(timeout=LAUNCHER_WAIT_S)
    r = w.killed
    assert r is not None, "said only once a rank is known killed (run() sets w.killed first)"
    ident = f"rank {r.rank} pid {r.pid}"
    signum = (r.status or 0) & 0x7F
    if r.status is None:
        what = f"was killed ({ident} vanished without running its exit path: SIGKILL, or a crash)"
    elif signum:
        what = f"was killed ({next((s.name for s in signal.Signals if s == signum), f'signal {signum}')}, {ident})"
    else:
        what = f"ended abruptly ({ident} exited with code {r.status >> 8} without running its exit path)"
    step, steps = w.phase.get("step"), w.args.steps
    name = str(w.phase.get("phase"))  # as sent (a str from rank 0's mark())
    phase = f"training step {step + 1}" + (f" of {steps}" if steps else "") if isinstance(step, int) else PHASES.get(name, name)
    total, limit = psutil.virtual_memory().total, cgroup_limit()
    limited = f"; the limit of its cgroup {limit / GIB:.1f} GiB" if limit is not None and limit < total else ""
    memory = (f"host memory peaked at {w.peak_used / GIB:.1f} of {total / GIB:.1f} GiB "
              f"(the job's processes {w.peak_job / GIB:.1f} GiB{limited})")
    with contextlib.suppress(OSError):  # a closed terminal or pipe: the cleanup is done anyway
        stderr_line("\n" + one_line(f"elsa_ds: error: the job {what} during {phase}; {memory}; {cause(w, r, total, limit)}; {cleaned}"))


def cause(w: Watch, killed: Rank, total: int, limit: int | None) -> str:
    """Whether the kernel's out-of-memory killer ended ``killed``: its counter when readable, else how full the memory was."""
    signum = (killed.status or 0) & 0x7F
    if w.runner is not None and w.runner.stopped and signum in (signal.SIGKILL, 0):
        return ("the launcher's SIGKILL, most likely: the watchdog had stopped the ranks of a deepspeed command that ended "
                "alone, and a rank still running 30 s later is killed")
    if killed.status is not None and signum != signal.SIGKILL:
        return ("not the out-of-memory killer (it sends SIGKILL)" if signum else
                "something in it called exit without unwinding (os._exit, a native library)")
    oom_now = oom_kills()
    if w.oom_before is not None and oom_now is not None:
        if oom_now > w.oom_before:
            return f"the kernel's out-of-memory killer ran meanwhile: most likely it ended the job; {OOM_ADVICE}"
        return ("the kernel's out-of-memory killer did not run: something else sent SIGKILL (a scheduler's limit, kill -9) "
                "or the process crashed")
    if w.peak_used >= 0.9 * total or (limit is not None and w.peak_job >= 0.9 * limit):
        return f"most likely the kernel's out-of-memory killer; {OOM_ADVICE}"
    return "the memory was not full when last seen: something sent SIGKILL (a scheduler's limit, kill -9) or the process crashed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m elsa_ds.files.watchdog", description=__doc__.partition("\n")[0])
    parser.add_argument("--pid", type=int, required=True, help="rank 0 (or the single process), which starts this")
    parser.add_argument("--launcher", type=int, default=0, help="the launcher whose children are the job's ranks (0: none)")
    parser.add_argument("--ranks", type=int, default=1, help="how many ranks the launcher starts on this node")
    parser.add_argument("--steps", type=int, default=0, help="the job's training steps (0: unknown)")
    parser.add_argument("--lock", required=True, help="the output's lock file, held by rank 0")
    parser.add_argument("--clean", action="append", default=[], help="a path rank 0's exit path removes (repeatable)")
    parser.add_argument("--resumable", action="append", default=[], help="a --clean path kept once --published exists")
    parser.add_argument("--output", default="", help="the output (absolute): its published checkpoint, what was set aside")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C or hangup is the job's business
        signal.signal(sig, signal.SIG_IGN)
    w = Watch(args)
    add_rank(w, args.pid, 0)
    if args.pid not in w.ranks:
        return 1
    w.before = {p: path_state(Path(p)) for p in args.clean}
    w.oom_before = oom_kills()
    discover(w)
    w.runner = find_runner(args.launcher)
    if os.fork() > 0:
        os._exit(0)  # rank 0 waits for this first process only: it goes on as the watch begins
    os.chdir("/")
    watch(w, sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
