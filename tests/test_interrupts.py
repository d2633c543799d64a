"""Ctrl-C and SIGTERM at any point of a job: one line, exit 130 / 143, no traceback, the previous output untouched, no
stray files beside it (staging, lock, warm-start copies), and a checkpointed run resumable afterwards. A plain process
through launch/prune.py during the warm start and training, the Python API during the export, and 2 ranks under the
deepspeed launcher during training."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elsa_ds.cli import prune_parser
from elsa_ds.errors import ElsaError, guarded
from elsa_ds.zero.dist import free_port
from tests.conftest import ROOT, run_entry, run_fails

pytestmark = pytest.mark.integration

FAST = ["--seqlen", "64", "--interval", "4", "--sparsity", "0.6", "--lr", "1e-3", "--lmda", "0.05", "--val_windows", "0",
        "--baseline", "none", "--micro_batch", "2", "--seed", "3", "--deepspeed", "ds_configs/zero3_offload.json"]


def _run_and_signal(cmd: list[str], when: str, send, timeout: float = 180, drain: float = 10) -> tuple[int, str]:
    """Start ``cmd``, call ``send(proc)`` once ``when`` shows in its output, return (exit code, stdout and stderr: what
    came before its pipe closed, or ``drain`` s after ``cmd`` ended). Unless ``cmd`` ended, nothing it started is left
    running (a 100000-step job, the launcher's ranks)."""
    import psutil

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # log: stdout
    seen, chunks = threading.Event(), []

    def read() -> None:
        while (c := proc.stdout.read(64)):
            chunks.append(c)
            if not seen.is_set() and when in "".join(chunks[-4:]):  # the last 256 characters: ``when`` across a chunk boundary
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert seen.wait(timeout), "".join(chunks)[-3000:]
        time.sleep(0.5)
        send(proc)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    reader.join(timeout=drain)
    return code, "".join(chunks)


def _interrupt(args: list[str], sig: int, when: str) -> tuple[int, str]:
    """launch/prune.py in one process, sent ``sig`` once ``when`` shows in its output."""
    # a shell without job control (CI) starts background jobs with SIGINT ignored, and Python then installs no Ctrl-C
    # handler: the child gets Python's own back, as a process started from a terminal has it, then runs the entry point
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    return _run_and_signal([sys.executable, "-c", start, str(ROOT / "launch" / "prune.py"), *args], when,
                           lambda proc: proc.send_signal(sig))


def _strays(tmp_path, name: str = "o") -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{name}."))


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("when", ["step/s", "sparsegpt", "resolved ELSA config"], ids=["training", "warm-start", "loading"])
def test_interrupt_keeps_the_previous_output_and_leaves_nothing(tmp_path, tiny_model_dir, text_dir, sig, code, when):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    (out / "elsa_report.json").write_text("{}")  # an earlier job's output, which --overwrite may replace
    start = ["--init_mask", "sparsegpt" if when == "sparsegpt" else "none"]
    rc, err = _interrupt([*FAST, *start, "--steps", "100000", "--model", str(tiny_model_dir), "--dataset", str(text_dir),
                          "--output_dir", str(out), "--overwrite"], sig, when)
    assert rc == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert sum(line.startswith("elsa_ds: interrupted") or line.startswith("elsa_ds: terminated")
               for line in err.splitlines()) == 1, err[-3000:]
    assert (out / "precious.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["elsa_report.json", "precious.txt"]
    assert _strays(tmp_path) == [], _strays(tmp_path)


@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_interrupted_checkpointed_run_resumes(tmp_path, tiny_model_dir, text_dir):
    """Ctrl-C after a checkpoint was published: --resume continues from it and ends with exact sparsity per layer."""
    out = tmp_path / "o"
    common = [*FAST, "--init_mask", "none", "--steps", "120", "--save_interval", "4", "--model", str(tiny_model_dir),
              "--dataset", str(text_dir), "--output_dir", str(out)]
    # the line that says a checkpoint was published (tqdm's bar skips counts: "9/40" never showed in one CI run, which then
    # ended its 40 steps before any signal); 120 steps leave the signal time to land on a loaded box
    rc, err = _interrupt(common, signal.SIGINT, "global_step8")
    assert rc == 130 and (out / "checkpoints" / "latest").exists(), err[-3000:]
    assert not (out / "elsa_report.json").exists() and _strays(tmp_path) == [], _strays(tmp_path)
    assert json.loads((out / "checkpoints" / "elsa_fingerprint.json").read_text())["sparsity"] == 0.6
    changed = [a if a != "0.6" else "0.7" for a in common]  # a changed setting: refused from that file, before loading
    err = run_fails("prune.py", [*changed, "--resume"], "--resume with changed settings", "sparsity 0.6 vs 0.7")
    # without --lr / --lmda the defaults rule would give others: the resumed run keeps the checkpoint's (the run started
    # with them), and says so (an upgrade that changes the rule does not stop a run half-way)
    unset = [a for i, a in enumerate(common) if a not in ("--lr", "--lmda") and common[i - 1] not in ("--lr", "--lmda")]
    run_entry("prune.py", [*unset, "--resume"])  # (without --resume the non-empty output would be refused)
    report = json.loads((out / "elsa_report.json").read_text())
    assert report["steps"] == 120 and 8 <= report["resumed_at_step"] < 120 and report["resumed_at_step"] % 4 == 0  # wall_s: since then
    kept = {k: report["defaults"]["applied"][k] for k in ("lr", "lmda", "warmup_steps")}
    assert kept == {"lr": 1e-3, "lmda": 0.05, "warmup_steps": 0}, report["defaults"]
    assert all("kept from the checkpoint" in report["defaults"]["why"][k] for k in kept), report["defaults"]
    for name, layer in report["layers"].items():
        assert layer["zeros"] == round(0.6 * layer["numel"]), name


def test_interrupt_during_the_export(tmp_path, tiny_model_dir, text_dir):
    """KeyboardInterrupt raised inside the safetensors export (after its first tensor) of a real ELSA run through the
    Python API: it reaches the caller, the previous output is untouched and no staging, lock or side file is left."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    (out / "elsa_report.json").write_text("{}")  # an earlier job's output, which --overwrite may replace
    script = f"""
import elsa_ds
from elsa_ds.files.safetensors_writer import ShardedWriter
real, calls = ShardedWriter.write, []
def write(self, name, tensor):
    calls.append(name)
    if len(calls) == 2:
        raise KeyboardInterrupt
    real(self, name, tensor)
ShardedWriter.write = write
try:
    elsa_ds.prune({str(tiny_model_dir)!r}, {str(text_dir)!r}, output_dir={str(out)!r}, overwrite=True,
                  deepspeed="zero3_offload", seqlen=64, steps=4, interval=2, sparsity=0.6, lr=1e-3, lmda=0.05,
                  val_windows=0, baseline="none", micro_batch=2, init_mask="none")
except KeyboardInterrupt:
    print("interrupted after", len(calls), "tensors")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert "interrupted after 2 tensors" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["elsa_report.json", "precious.txt"] and _strays(tmp_path) == [], _strays(tmp_path)


def test_ctrl_c_under_the_deepspeed_launcher(tmp_path, tiny_model_dir, text_dir):
    """A terminal's Ctrl-C under `deepspeed --num_gpus 2`: SIGINT reaches the launcher and both ranks, then the launcher
    sends each rank SIGTERM. Each rank says one line (the SIGTERM after it is ignored, so the cleanup runs to its end),
    the previous output stays, nothing is left beside it. The exit code is the launcher's own (1), not ours. On a loaded
    box rank 1 can end before rank 0's signal arrives, failing rank 0's collective first (``errors._after_peer_gone``:
    seen once in four runs under two test workers, 2026-11-29)."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    (out / "elsa_report.json").write_text("{}")  # an earlier job's output, which --overwrite may replace
    port = free_port()
    shm = f"deepspeed_*_{port}_*"  # this job's buffers only: another test worker may run a job beside it
    shm_before = set(Path("/dev/shm").glob(shm))

    def ctrl_c(proc) -> None:  # the terminal's process group minus DeepSpeed's runner (its own Ctrl-C traceback is DeepSpeed's)
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):
            child.send_signal(signal.SIGINT)
    code, text = _run_and_signal([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
                                  str(port), "launch/prune.py", *FAST, "--init_mask", "none", "--steps", "100000",
                                  "--model", str(tiny_model_dir), "--dataset", str(text_dir), "--output_dir", str(out),
                                  "--overwrite"], "step/s", ctrl_c, timeout=300)
    assert code != 0, text[-3000:]
    # a loaded box may deliver the launcher's SIGTERM before the Ctrl-C: either way, one line per rank
    ranks = [line for line in text.splitlines() if "elsa_ds: interrupted" in line or "elsa_ds: terminated" in line]
    assert len(ranks) == 2 and "Traceback" not in text, text[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["elsa_report.json", "precious.txt"] and _strays(tmp_path) == [], _strays(tmp_path)
    assert set(Path("/dev/shm").glob(shm)) <= shm_before  # the ranks' shared-memory buffers are gone too



@pytest.mark.parametrize("raised, code", [(KeyboardInterrupt(), 130), (ElsaError("bad"), 2)])
def test_each_ranks_line_is_one_write(monkeypatch, raised, code):
    """Under the launcher (``python -u``) print's text and its newline were two writes, and two ranks' Ctrl-C lines once
    ran together on one line of the shared pipe (CI, 2026-11-28): the line and its newline now go in one write."""
    class Recorder:
        def __init__(self):
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    def fail():
        raise raised

    err, handlers = Recorder(), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("RANK", "1")
    try:
        assert guarded(fail) == code
    finally:  # guarded() installs the entry points' handlers: this process keeps its own
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert len(err.writes) == 1 and err.writes[0].startswith("elsa_ds: ") and err.writes[0].endswith("\n")
    assert "(rank 1)" in err.writes[0] and err.writes[0].count("\n") == 1


PEER = """
import os, signal, sys, threading, time
import torch, torch.distributed as dist
from elsa_ds.errors import guarded

def job():
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(0.5)
        os._exit(0)  # gone while rank 0 waits in the all-gather
    if sys.argv[1] == "stopped":  # the launcher's SIGTERM, after the collective has failed
        threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    dist.all_gather([torch.zeros(4), torch.zeros(4)], torch.ones(4))

sys.exit(guarded(job))
"""


@pytest.mark.parametrize("how, code, line", [("stopped", 143, "elsa_ds: terminated (SIGTERM): nothing unfinished"),
                                             ("alone", 1, "elsa_ds: error: another rank of this job ended first "
                                                          "(Connection closed by peer)")])
def test_a_rank_whose_peer_is_gone_says_one_line(how, code, line):
    """Two real gloo ranks; rank 1 exits while rank 0 waits in an all-gather, which fails with gloo's "Connection closed by
    peer". Rank 0 waits a moment for its own stop (a terminal's Ctrl-C, the launcher's SIGTERM) and reports that; with
    none, one line naming the other rank's end. Never gloo's traceback (the race the launcher Ctrl-C test once hit)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", PEER, how], cwd=ROOT, env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    (_, err), _ = (p.communicate(timeout=120) for p in procs)
    lines = [x for x in err.splitlines() if x.startswith("elsa_ds: ")]
    assert procs[0].returncode == code and "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(line), lines[0]


def test_only_a_gone_peer_is_taken_for_one(monkeypatch, capsys):
    """Any other RuntimeError is a bug: it propagates with its traceback."""
    from elsa_ds import errors

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(errors, "PEER_GRACE_S", 0.1)
    try:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            guarded(lambda: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
        assert errors.peer_gone(RuntimeError("[pair.cc:534] Connection reset by peer [127.0.0.1]:1"))
        assert not errors.peer_gone(ValueError("Connection closed by peer"))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert capsys.readouterr().err == ""


ALONE = """
import sys
import deepspeed  # imported before the sign, as init_distributed imports it
from elsa_ds.errors import guarded
from elsa_ds.zero.dist import init_distributed

print("ready", flush=True)
sys.exit(guarded(init_distributed))
"""


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_waiting_for_peers_that_never_come_ends_on_sigterm(rank):
    """A launched rank whose peers never start (a node that failed, a WORLD_SIZE too large) waits at the rendezvous: in
    torch's C++ wait it sat through SIGTERM and Ctrl-C for DeepSpeed's 10 minutes. Rank 0 serving the store, or rank 1
    looking for it, now ends within seconds of the launcher's SIGTERM, in the job's one line."""
    port = free_port()
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", ALONE], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "ready\n" in iter(proc.stdout.readline, "")  # DeepSpeed's log lines first
        deadline = time.monotonic() + 60
        while rank == 0 and not _listening(port) and time.monotonic() < deadline:  # waiting in the rendezvous now
            time.sleep(0.1)
        time.sleep(3.0)  # rank 1: looking for rank 0's store by now
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert [x for x in err.splitlines() if x.startswith("elsa_ds: ")] == [
        f"elsa_ds: terminated (SIGTERM){'' if rank == 0 else ' (rank 1)'}: nothing unfinished was published"], err[-3000:]


RENDEZVOUS_ALONE = """
import os, sys
from elsa_ds.errors import ElsaError
from elsa_ds.zero.rendezvous import gather

os.environ["RANK"] = sys.argv[1]
try:
    gather(1.0)
except ElsaError as err:
    print(err)
"""


@pytest.mark.parametrize("rank, said", [(0, "the rendezvous at 127.0.0.1:{port}: 1 of 2 ranks arrived in 1 s"),
                                        (1, "rank 1 could not reach the rendezvous at 127.0.0.1:{port} (rank 0's) in 1 s")])
def test_a_rendezvous_that_never_fills_says_how_many_came(rank, said):
    """Past DeepSpeed's timeout, one line: how many ranks came, or that rank 0's store was never found, and where."""
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", RENDEZVOUS_ALONE, str(rank)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60).stdout
    assert out.startswith(said.format(port=port)) and "DEEPSPEED_TIMEOUT minutes" in out and "MASTER_ADDR" in out, out


SIGNAL_AT_EXIT = """
import atexit, os, signal, sys, time
from elsa_ds.errors import ElsaError, guarded, run_command

def job():
    raise ElsaError("refused")

code = guarded(job)
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))  # the launcher ending this rank, late
ENDING
"""
# how the process ends: Python's own exit, or as the entry points end it (run_command: the exit's callbacks, os._exit)
ENDINGS = pytest.mark.parametrize("ending", ["sys.exit(code)", "run_command(lambda: code)"])


@ENDINGS
def test_a_sigterm_during_the_interpreters_exit_prints_no_traceback(ending):
    """Under the launcher a rank that refused (exit 2) may be sent SIGTERM while Python runs its exit callbacks (a
    sibling's exit ends the job; CI 2026-12-01 saw "Exception ignored in atexit callback ... Terminated"). Once the job is
    over the handlers it found are back: the signal ends the process as it would have, one error line, no traceback."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = SIGNAL_AT_EXIT.replace("ENDING", ending)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -15, (proc.returncode, proc.stderr)
    assert proc.stderr.strip() == "elsa_ds: error: refused"


@ENDINGS
def test_a_sigterm_after_a_finished_job_says_its_output_is_complete(ending):
    """A scheduler's SIGTERM a second late, while a finished job's interpreter winds down: it ended 143 without a word
    (a user's walk) and was taken for a killed run. One line now says what it wrote is complete; no traceback."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    finished = SIGNAL_AT_EXIT.replace('raise ElsaError("refused")', "return 0").replace("ENDING", ending)
    proc = subprocess.run([sys.executable, "-c", finished], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert proc.stderr.strip() == "elsa_ds: terminated (SIGTERM) after the job had finished: what it wrote is complete"


COMMAND = """
import atexit, ctypes, sys, threading, time
from elsa_ds.errors import run_command

class Finalized:
    def __del__(self):
        print("finalized", flush=True)  # the interpreter's finalization, which run_command's os._exit skips

kept = Finalized()

def later():
    time.sleep(0.5)
    print("thread done", end=" ")

def main():
    threading.Thread(target=later).start()
    atexit.register(print, "second callback")
    atexit.register(print, "first callback", end=" ")
    ctypes.CDLL(None).printf(b"C stdio, buffered in a pipe\\n")
    print("job done", end=" ")
    RESULT
"""


@pytest.mark.parametrize("result, code, out, err", [
    ("return 3", 3, "job done thread done first callback second callback", ""),
    ("raise SystemExit(2)", 2, "job done thread done first callback second callback", ""),
    ("raise SystemExit('stopped: why')", 1, "job done thread done first callback second callback", "stopped: why"),
])
def test_a_command_ends_after_its_exit_work_without_the_interpreters_finalization(result, code, out, err):
    """run_command (launch/prune.py, elsa-prune, a probe rank): the code main returned (or SystemExit's, as Python gives it),
    after a thread that is not a daemon has finished, the atexit callbacks in their order, Python's streams and C's stdio
    flushed into a pipe (the C line would be lost to os._exit otherwise); finalization (where finished ranks died in
    std::terminate) is skipped: the object's __del__ never runs."""
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # -u would leave C's stdio unbuffered
    proc = subprocess.run([sys.executable, "-c", COMMAND.replace("RESULT", result) + "run_command(main)\n"], cwd=ROOT,
                          env=buffered, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert sorted(proc.stdout.splitlines()) == sorted(["C stdio, buffered in a pipe", out]), proc.stdout  # two buffers
    assert "finalized" not in proc.stdout and proc.stderr.strip() == err


def test_the_finalization_probe_sees_pythons_own_exit():
    """The control of the tests' ``__del__`` probe: without run_command, Python's exit finalizes, and the probe says so."""
    plain = subprocess.run([sys.executable, "-c", COMMAND.replace("RESULT", "return 0") + "sys.exit(main())\n"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert "finalized" in plain.stdout


THREADS = """
import concurrent.futures, os, signal, sys, threading, time
from elsa_ds.errors import run_command

signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's: a shell's background job starts with it ignored
pool = concurrent.futures.ThreadPoolExecutor(2)  # idle workers that only threading's exit hooks wake (inductor keeps one)

def second():
    time.sleep(0.3)
    print("second thread", flush=True)

def first():
    pool.submit(print, "pooled", flush=True).result()
    started = threading.Thread(target=second)
    started.start()  # while the exit joins its parent
    CTRL_C
    time.sleep(0.5)
    print("first thread", flush=True)

def main():
    threading.Thread(target=first).start()
    return 3

run_command(main)
"""


@pytest.mark.parametrize("ctrl_c", [False, True])
def test_a_command_waits_for_threads_as_python_does_and_a_ctrl_c_then_keeps_its_code(ctrl_c):
    """run_command's exit is threading's own shutdown: a ThreadPoolExecutor's idle workers are woken (a hand-written join
    hung on them, a review found: inductor's compile pool on a cold cache), a thread that a joined thread started is
    waited for too. A Ctrl-C while the exit waits is printed, as Python prints it, and the job's code stands (it was a
    traceback and the interpreter's finalization, rc -2)."""
    script = THREADS.replace("CTRL_C", "started.join(); os.kill(os.getpid(), signal.SIGINT)" if ctrl_c else "pass")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["pooled", "second thread"], proc.stdout
    if ctrl_c:
        assert proc.stderr.startswith("Exception ignored in: <module 'threading'") and "KeyboardInterrupt" in proc.stderr
    else:
        assert proc.stdout.splitlines() == ["pooled", "second thread", "first thread"] and proc.stderr == ""


def test_an_exception_out_of_a_command_leaves_as_python_leaves():
    """Anything but SystemExit is not a command's result: its traceback and Python's exit code 1, as without run_command."""
    proc = subprocess.run([sys.executable, "-c", COMMAND.replace("RESULT", "raise ValueError('unplanned')") + "run_command(main)\n"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ValueError: unplanned" in proc.stderr and "Traceback" in proc.stderr


STREAMS = """
import os, signal, sys, time
from elsa_ds.errors import run_command

signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's: a shell's background job starts with it ignored

def main():
    while not os.path.exists(sys.argv[2]):  # the test's go: its end of the pipe is closed by then
        time.sleep(0.02)
    print("a line", flush=True)
    print("another line")
    sys.stdout.writelines(["y" * 100_000, "\\n"])  # past the buffer: written at once (a review: writelines raised)
    open(sys.argv[1], "w").write("went on")
    return CODE

run_command(main)
"""


@pytest.mark.parametrize("output", ["/dev/full", "closed pipe"])
@pytest.mark.parametrize("code, ends", [(0, 120), (3, 3)])
def test_a_command_whose_stdout_cannot_be_written_goes_on_and_says_so_once(tmp_path, output, code, ends):
    """A fifth audit (2026-12-06): a job whose stdout's reader had gone (``| head -1``) stopped with a traceback at the next
    print (DeepSpeed's, as it loads an op), and one whose stdout could not grow (``> /dev/full``) was stopped as a full
    disk under its output folder. Now the first failed write says so once on stderr and the command goes on; its exit
    code is 120 where it would be 0 (what Python's own exit gives for output it could not write), its own otherwise."""
    went_on, go = tmp_path / "went_on", tmp_path / "go"
    script = STREAMS.replace("CODE", str(code))
    with open(output if output == "/dev/full" else os.devnull, "w") as full:
        proc = subprocess.Popen([sys.executable, "-c", script, str(went_on), str(go)], cwd=ROOT, text=True,
                                stdout=full if output == "/dev/full" else subprocess.PIPE, stderr=subprocess.PIPE)
        if proc.stdout is not None:
            proc.stdout.close()  # the reader gone: EPIPE at the next write
        go.touch()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == ends and went_on.read_text() == "went on", err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("elsa_ds: warning: the standard output cannot be written ("), err
    assert ("Broken pipe" if output == "closed pipe" else "No space left") in lines[0]


def test_a_job_whose_stdout_is_full_publishes_its_output_and_says_why_it_ends_120(tmp_path, tiny_model_dir, text_dir):
    """launch/prune.py with its log sent to a device that cannot grow: the job was stopped as a full disk under its output
    folder ("no space left on ... writing .../o"), though the output's disk had room. It now publishes its output."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, str(ROOT / "launch" / "prune.py"), "--model", str(tiny_model_dir), "--dataset",
                               str(text_dir), "--seqlen", "64", "--sparsity", "0.6", "--val_windows", "0", "--deepspeed",
                               "ds_configs/zero3_offload.json", "--method", "magnitude", "--output_dir", str(tmp_path / "o")], cwd=ROOT,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    said = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds:")]
    assert proc.returncode == 120 and len(said) == 1 and "standard output cannot be written" in said[0], proc.stderr[-3000:]
    assert (tmp_path / "o" / "model.safetensors").is_file() and (tmp_path / "o" / "elsa_report.json").is_file()
    assert _strays(tmp_path) == []


API_FULL = """
import sys
import elsa_ds
from elsa_ds.errors import ElsaError
from elsa_ds.jobs import report

if sys.argv[4] == "print":  # a print inside the job (as DeepSpeed prints while it builds an op), past the buffer
    publish = report.publish_report
    report.publish_report = lambda *a: (print("x" * 100_000), publish(*a))
streams = sys.stdout, sys.stderr
try:
    elsa_ds.oneshot(sys.argv[1], "magnitude", sys.argv[2], output_dir=sys.argv[3], seqlen=64, sparsity=0.6, val_windows=0)
except ElsaError as err:
    sys.stderr.write("refused: " + str(err) + chr(10))
assert (sys.stdout, sys.stderr) == streams  # the caller's own, as they were
"""


@pytest.mark.parametrize("job", ["log", "print"])
def test_a_python_callers_full_stdout_is_said_once_and_never_blamed_on_the_output(tmp_path, tiny_model_dir, text_dir, job):
    """elsa_ds.oneshot from a script whose stdout went to a full disk (the caller's own streams: std_streams.install is
    the commands' alone). Its log lines printed a 30-line "Logging error" each: now said once, then dropped, and the job
    publishes. A print inside the job raises there, as the caller's print would: it was reported as a full disk under
    --output_dir ("no space left on ... writing .../o"), whose disk had room; now the stream is named."""
    out = tmp_path / "o"
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", API_FULL, str(tiny_model_dir), str(text_dir), str(out), job], cwd=ROOT,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    said = [line for line in proc.stderr.splitlines() if line.startswith(("elsa_ds:", "refused: "))]
    # DeepSpeed's own handler says its accelerator at import, before any job: its "Logging error" is its own
    theirs = proc.stderr.count("Message: 'Setting accelerator to CPU.")
    assert proc.returncode == 0 and proc.stderr.count("Logging error") == theirs, proc.stderr[-3000:]
    assert said[0].startswith("elsa_ds: warning: the standard output cannot be written") and "No space left" in said[0]
    if job == "log":
        assert len(said) == 1 and (out / "model.safetensors").is_file() and (out / "elsa_report.json").is_file(), said
    else:
        assert len(said) == 2 and said[1].startswith("refused: the job stopped: a write to its standard output failed"), said
        assert "No space left" in said[1] and "writing" not in said[1] and not out.exists()
    assert _strays(tmp_path) == []


def test_two_jobs_at_once_keep_the_callers_streams_marked_until_the_last_ends(monkeypatch):
    """Two API jobs in two threads, overlapping: the first to end put back the caller's streams, and a full stdout in the
    second's was then an unmarked OSError, reported as a full disk under its --output_dir. Now the mark lasts until the
    last job inside ends, and the streams come back as they were."""
    from elsa_ds import std_streams
    from elsa_ds.errors import stream_of

    full = open("/dev/full", "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", full)
    first, second = std_streams.marked(), std_streams.marked()
    first.__enter__()
    ready, done, seen = threading.Event(), threading.Event(), []

    def job() -> None:
        with second:
            ready.set()
            done.wait(60)
            try:
                print("a line of the second job")
            except OSError as err:
                seen.append(stream_of(err))

    thread = threading.Thread(target=job)
    thread.start()
    assert ready.wait(60)
    first.__exit__(None, None, None)  # the first job ends while the second runs
    done.set()
    thread.join(60)
    restored = sys.stdout is full
    with contextlib.suppress(OSError):  # the line it could not write is still in its buffer
        full.close()
    assert seen == ["stdout"] and restored


def test_a_command_whose_stderr_is_closed_and_stdout_full_goes_on(tmp_path):
    """A review: with stderr closed when the process started (``2>&-``: sys.stderr is None) the warning about a full stdout
    raised an AttributeError out of the job's print."""
    went_on, go = tmp_path / "went_on", tmp_path / "go"
    go.touch()
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", STREAMS.replace("CODE", "0"), str(went_on), str(go)], cwd=ROOT,
                              stdout=full, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.close(2), timeout=60)
    assert proc.returncode == 120 and went_on.read_text() == "went on"


FLUSH_WAITS = """
import signal, sys
from elsa_ds.errors import run_command

signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's: a shell's background job starts with it ignored

def main():
    sys.stdout.write("x" * 64512); sys.stdout.flush()  # the pipe nobody reads: 1 KiB of it left
    sys.stdout.write("y" * 4000)  # buffered: the exit's flush waits on the pipe
    print("ready", file=sys.stderr, flush=True)
    return 0

run_command(main)
"""


def test_a_ctrl_c_while_the_last_output_is_flushed_ends_as_pythons_exit_would():
    """A fifth audit: a finished command whose last line waited for a full pipe, stopped by Ctrl-C, left a traceback and
    rc -2 through the interpreter's finalization that run_command skips; Python's own exit gives 120 there."""
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # -u would write the 4000 bytes at once
    proc = subprocess.Popen([sys.executable, "-c", FLUSH_WAITS], cwd=ROOT, env=buffered, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline() == "ready\n"  # main has returned: its exit waits to flush the 4000 bytes
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 120 and "Traceback" not in err and out == "x" * 64512, err


@pytest.mark.parametrize("result", ["None", "0", "3", "True", "256", "-1", "2**31 + 3", "2**70", "'a message'"])
def test_a_commands_exit_code_is_the_one_python_gives(result):
    """What main returns gives the exit code that ``sys.exit`` of it gives, past a C int and a C long too (os._exit of
    2**70 was an OverflowError's traceback)."""
    codes = [subprocess.run([sys.executable, "-c", f"import sys\nfrom elsa_ds.errors import run_command\n{ending}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60) for ending in (f"sys.exit({result})",
                                                                                      f"run_command(lambda: {result})")]
    assert [(p.returncode, p.stderr) for p in codes] == [(codes[0].returncode, codes[0].stderr)] * 2


def _parsers():
    from elsa_ds.cli import estimate_parser, evaluate_parser
    from elsa_ds.sparse.cli import parser as compress_parser

    return {"prune": prune_parser, "evaluate": evaluate_parser, "estimate": estimate_parser, "compress": compress_parser}


@pytest.mark.parametrize("entry", [f"{how}{name}" for name in ("prune", "evaluate", "estimate", "compress")
                                   for how in ("launch/", "elsa-")])
def test_the_entry_points_end_as_commands(entry, monkeypatch):
    """launch/{prune,evaluate,estimate,compress}.py and the elsa-* scripts (as pyproject's [project.scripts] names them,
    run as pip's wrapper runs them) end through run_command: --help is printed whole, exit 0, and an object left for the
    interpreter's finalization is never finalized."""
    import tomllib

    if entry.startswith("elsa-"):
        module, func = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][entry].split(":")
        run = f"import sys, {module} as m; sys.exit(m.{func}())"
    else:
        run = f"import runpy; runpy.run_path({str(ROOT / entry)!r} + '.py', run_name='__main__')"
    probe = "import sys\nclass F:\n    def __del__(self): print('finalized')\nkept = F()\nsys.argv = ['x', '--help']\n"
    monkeypatch.setenv("COLUMNS", "120")  # argparse's width, here and there
    proc = subprocess.run([sys.executable, "-c", probe + run], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == _parsers()[entry.split("/")[-1].removeprefix("elsa-")]().format_help()


CLOSED_AT_START = """
import os, subprocess, sys
from elsa_ds.errors import run_command
from elsa_ds.log import ConsoleHandler
import logging

def main():
    kept = open(sys.argv[1], "a")  # a file the job opens (the output's lock took descriptor 1 with >&-)
    sys.stderr.write(f"the job's file is descriptor {kept.fileno()}\\n")
    print("a line nobody reads", flush=True)
    os.write(1, b"a C-level write\\n")
    subprocess.run(["echo", "a child's output"], check=True)
    record = logging.LogRecord("elsa_ds", logging.INFO, "", 0, "a log line", None, None)
    ConsoleHandler(0).handle(record)
    kept.close()
    return 0

run_command(main)
"""


def test_a_command_started_with_its_stdout_closed_writes_nowhere_and_not_into_its_own_files(tmp_path):
    """A sixth audit: with descriptor 1 closed when the command started (``>&-``), sys.stdout was None (each log line a
    30-line "Logging error"; elsa-prune stopped in DeepSpeed's op build flushing None), and the first file the job opened,
    the output's lock, took descriptor 1: a C-level write or a child's output would land in it. Now the descriptor is
    the null device's before main runs."""
    kept = tmp_path / "kept"
    proc = subprocess.run([sys.executable, "-c", CLOSED_AT_START, str(kept)], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1), timeout=60)
    assert proc.returncode == 0 and proc.stderr == "the job's file is descriptor 3\n", proc.stderr[-2000:]
    assert kept.read_text() == ""
