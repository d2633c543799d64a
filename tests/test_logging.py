"""The console: rank 0 logs at --log_level, other ranks warnings only, library warnings a user cannot act on filtered."""
from __future__ import annotations

import io
import logging
import subprocess
import sys
import warnings

import pytest

from elsa_ds.log import EVERY_RANK, QUIET_LIBRARY_RECORDS, QUIET_WARNINGS, ROOT, get_logger, logging_for, setup_logging
from tests.conftest import ROOT as REPO, run_entry


@pytest.fixture
def console():
    """setup_logging changes process-wide state: put the elsa_ds logger and the warning filters back afterwards."""
    root = logging.getLogger(ROOT)
    handlers, level = list(root.handlers), root.level
    with warnings.catch_warnings():
        yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_rank_zero_logs_info_to_stdout_and_warnings_to_stderr(console, capsys):
    setup_logging("info", rank=0)
    log = get_logger("elsa_ds.test")
    log.info("pruning 7 layers")
    log.warning("c4 gave 12 windows")
    out, err = capsys.readouterr()
    assert out == "[elsa_ds] pruning 7 layers\n"
    assert err == "elsa_ds: warning: c4 gave 12 windows\n"


def test_other_ranks_show_warnings_only_tagged_with_their_rank(console, capsys):
    setup_logging("debug", rank=1)
    log = get_logger("elsa_ds.test")
    log.info("pruning 7 layers")
    log.debug("details")
    log.warning("disk is slow")
    log.info("sparsegpt runs in one process (rank 0); nothing to do here", extra=EVERY_RANK)
    out, err = capsys.readouterr()
    assert "pruning" not in out and "details" not in out
    assert out == "[elsa_ds] rank 1: sparsegpt runs in one process (rank 0); nothing to do here\n"
    assert err == "elsa_ds: warning (rank 1): disk is slow\n"


def test_log_level_warning_hides_info_and_debug_shows_it(console, capsys):
    setup_logging("warning", rank=0)
    log = get_logger("test_module")  # a name outside the package is put below elsa_ds
    log.info("hidden")
    log.error("shown")
    out, err = capsys.readouterr()
    assert out == "" and err == "elsa_ds: error: shown\n"
    setup_logging("debug", rank=0)
    log.debug("now shown")
    assert capsys.readouterr().out == "[elsa_ds] now shown\n"
    with pytest.raises(ValueError, match="debug, info, warning, error"):
        setup_logging("loud")


def test_a_python_programs_own_logging_gets_the_records_once_and_a_commands_console_is_its_own(console, capsys):
    """A fifteenth audit (2026-12-07): a program's ``logging.basicConfig(filename=...)`` got no elsa_ds line, every one
    went to the console alone. The API's console (and the default one) hands each record to the program's handlers at
    their levels, as propagation would, and writes nothing itself; without such handlers it writes; a command's is its own."""
    program, quiet = io.StringIO(), io.StringIO()
    handlers = [logging.StreamHandler(program), logging.StreamHandler(quiet)]
    handlers[1].setLevel(logging.WARNING)
    log, root = get_logger("elsa_ds.test"), logging.getLogger()
    for handler in handlers:
        root.addHandler(handler)
    try:
        with logging_for("info"):
            log.info("pruning 7 layers")
            log.warning("c4 gave 12 windows")
        assert program.getvalue() == "pruning 7 layers\nc4 gave 12 windows\n" and quiet.getvalue() == "c4 gave 12 windows\n"
        assert capsys.readouterr() == ("", "")
        setup_logging("info", rank=0)  # a command's console
        log.info("loaded")
        assert capsys.readouterr().out == "[elsa_ds] loaded\n" and "loaded" not in program.getvalue()
    finally:
        for handler in handlers:
            root.removeHandler(handler)
    with logging_for("info"):
        log.info("no handler of the program's")
    assert capsys.readouterr().out == "[elsa_ds] no handler of the program's\n"


def test_evaluate_log_level_warning_keeps_the_table_and_drops_the_progress_lines(tmp_path, tiny_model_dir, text_dir):
    text = sorted(text_dir.glob("*.txt"))[0]
    args = ["--model", str(tiny_model_dir), "--ppl", str(text), "--seqlen", "32", "--limit", "2"]
    default = run_entry("evaluate.py", args, timeout=300)
    quiet = run_entry("evaluate.py", [*args, "--log_level", "warning"], timeout=300)
    assert "[elsa_ds] loaded" in default.stdout and "[elsa_ds] evaluation settings" in default.stdout
    assert "[elsa_ds]" not in quiet.stdout
    table = [line for line in default.stdout.splitlines() if line.startswith("|")]
    assert table and table == [line for line in quiet.stdout.splitlines() if line.startswith("|")]


SCRIPT = """
import sys, warnings
import torch
from transformers import AutoModelForCausalLM
from deepspeed.utils import logger as ds_logger
from elsa_ds.log import setup_logging
if sys.argv[1] == "filtered":  # otherwise Python's default filters: FutureWarning and UserWarning shown
    setup_logging("info", rank=0)
AutoModelForCausalLM.from_pretrained(sys.argv[2]).gradient_checkpointing_enable()
torch.zeros(2).storage()
ds_logger.warning("**** You are using ZeRO with an untested optimizer, proceed with caution *****")
ds_logger.warning("an unrelated DeepSpeed warning")
warnings.warn("an unrelated deprecation", FutureWarning)
"""


def _warnings_of(mode: str, model_dir) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(model_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_library_warnings_a_user_cannot_act_on_are_filtered_and_others_are_not(tiny_model_dir):
    shown = _warnings_of("plain", tiny_model_dir)
    filtered = _warnings_of("filtered", tiny_model_dir)
    quiet = ["`gradient_checkpointing_enable` is deprecated", "TypedStorage is deprecated",
             "You are using ZeRO with an untested optimizer"]
    for text in quiet:
        assert text in shown, f"the library no longer warns {text!r}: drop its filter from elsa_ds/log.py"
        assert text not in filtered
    for text in ("an unrelated DeepSpeed warning", "an unrelated deprecation"):
        assert text in shown and text in filtered
    assert all(why for *_, why in QUIET_WARNINGS + QUIET_LIBRARY_RECORDS)  # each filter says why it is safe


def test_torch_collective_deprecation_is_filtered(console):
    setup_logging("info", rank=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from elsa_ds.log import filter_warnings

        filter_warnings()
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...", FutureWarning)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated", UserWarning)  # another category
    assert [str(w.message) for w in seen] == ["`torch.distributed.all_gather_into_tensor` is deprecated"]


def test_ranks_of_one_launcher_say_a_shared_refusal_once(tmp_path, tiny_model_dir):
    """Ranks started together on the same bad input refuse it alike: a pre-flight refusal was printed once per rank (16
    copies on 2 x 8 GPUs, a user's walk of 2026-11-30). Under the launcher, a bad value and an unknown flag: one line, exit 2."""
    common = ["--deepspeed", "ds_configs/zero3_offload.json", "--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "out")]
    for bad in (["--sparsity", "1.5"], ["--sparsty", "0.5"]):
        proc = run_entry("prune.py", [*common, *bad], ranks=2, check=False, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
        assert proc.returncode == 2 and len(errors) == 1 and bad[0].strip("-")[:6] in errors[0], proc.stderr[-3000:]
        assert errors[0].startswith("elsa_ds: error: "), errors  # the command's refusal, not one rank's: no "(rank 1)"
        # the rank that said it lingers while the others reach it; the launcher's SIGTERM then ends it without a word
        assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_a_line_is_claimed_once_per_launcher_and_different_lines_are_all_said(monkeypatch):
    """The claim behind it: the first process under a launcher of several ranks (LOCAL_RANK set, WORLD_SIZE > 1) to say a
    line says it; a sibling (same parent) finds it claimed while the first lives, and says it once the first has ended;
    another line is said, and a line a process said before is said again by it; a single process says every line; a rank
    whose standard error is its own file (``--enable_each_rank_log``) says it there, the reason in each rank's log."""
    import os
    import tempfile
    import uuid

    from elsa_ds.errors import first_to_say

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert first_to_say("a line") and first_to_say("a line")
    line = f"refused {uuid.uuid4().hex}"
    code = "import sys, time; from elsa_ds.errors import first_to_say; print(first_to_say(sys.argv[1]), flush=True); time.sleep(float(sys.argv[2]))"
    env = {**os.environ, "LOCAL_RANK": "0", "WORLD_SIZE": "2"}

    def rank(pause: float, stderr=subprocess.DEVNULL) -> subprocess.Popen:  # not a file: the launcher's one place
        return subprocess.Popen([sys.executable, "-c", code, line, str(pause)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)

    first = rank(30)
    assert first.stdout.readline().strip() == "True"
    second = rank(0)
    assert second.communicate(timeout=60)[0].strip() == "False"
    with tempfile.TemporaryFile() as own_log:
        assert rank(0, stderr=own_log).communicate(timeout=60)[0].strip() == "True"
    assert rank(0, stderr=subprocess.PIPE).communicate(timeout=60)[0].strip() == "False"  # a pipe of its own (mpirun, srun)
    first.kill()
    first.wait()
    assert rank(0).communicate(timeout=60)[0].strip() == "True"  # the claim went with the process
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process (elsa_ds sets these for itself): never silent
    assert first_to_say(line) and first_to_say(line)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert first_to_say(line + " and more") and first_to_say(line + " and more")  # this process's own claim


LATE_SIGTERM = """
import atexit, os, signal, sys, time
def late():  # registered before the claim's linger, so it runs after it: the launcher's SIGTERM a moment too late
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    print("exit callbacks ran on", flush=True)
atexit.register(late)
from elsa_ds import errors
errors.CLAIM_LINGER_S = 0.05
errors.first_to_say(sys.argv[1])
sys.exit(2)
"""


def test_the_launchers_sigterm_after_the_claims_linger_ends_the_rank_without_a_word(tmp_path):
    """CI, 2026-12-03: a rank that had said the refusal lingered, then the launcher's SIGTERM arrived while the interpreter
    ran its later exit callbacks (torch's), and Terminated raised there printed "Exception ignored in atexit callback"
    with a traceback. After the linger a signal no longer raises: the exit goes on, with the rank's own code."""
    import os
    import uuid

    env = {**os.environ, "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "-c", LATE_SIGTERM, f"refused {uuid.uuid4().hex}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "exit callbacks ran on" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


def test_a_settings_refusal_names_no_rank_and_a_ranks_own_check_does(monkeypatch, capsys):
    """A walk (2026-12-02): under the launcher a bad --sparsity was said once, as "elsa_ds: error (rank 1): ...", which read
    as one rank's problem. A setting refused by its own rule is every rank's (no rank); a check of this rank's machine
    (a review: one GPU's free memory, taken by another process) still says which rank it is."""
    from elsa_ds.errors import ElsaError, guarded
    from elsa_ds.settings.config import resolve_config

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert guarded(lambda: resolve_config({}, {"sparsity": 1.5})) == 2
    assert capsys.readouterr().err.startswith("elsa_ds: error: invalid setting in the command line: sparsity=1.5")

    def gpu_full():
        raise ElsaError("needs ~40 GiB GPU memory, this GPU has 12 GiB available")

    assert guarded(gpu_full) == 2
    assert capsys.readouterr().err.strip() == "elsa_ds: error (rank 1): needs ~40 GiB GPU memory, this GPU has 12 GiB available"


def test_a_console_stream_that_cannot_be_written_is_said_once_on_the_other_and_never_raises(monkeypatch):
    """A Python caller's stdout on a full disk: each record printed logging's 30-line "Logging error"; now the handler
    says it once on stderr and drops what goes to stdout. With stderr broken too (closed), nothing raises into the job
    (a review: the warning's own write escaped the handler)."""
    import contextlib
    import io

    from elsa_ds.log import ConsoleHandler

    record = logging.LogRecord("elsa_ds.x", logging.INFO, __file__, 1, "a line", None, None)
    for closed_stderr in (False, True):
        handler, err = ConsoleHandler(0), io.StringIO()
        if closed_stderr:
            err.close()
        full = open("/dev/full", "w", buffering=1)
        monkeypatch.setattr(sys, "stdout", full)
        monkeypatch.setattr(sys, "stderr", err)
        for _ in range(3):
            handler.emit(record)  # raises nothing
        monkeypatch.undo()
        with contextlib.suppress(OSError):  # what the failed writes left in its buffer
            full.close()
        assert set(handler.lost) == ({"stdout", "stderr"} if closed_stderr else {"stdout"})
        if not closed_stderr:
            said = err.getvalue().splitlines()
            assert len(said) == 1 and said[0].startswith("elsa_ds: warning: the standard output cannot be written")


def test_a_path_that_is_not_utf8_is_shown_escaped_on_a_strict_console(tmp_path, tiny_model_dir, text_dir):
    """A seventh audit: a --ppl folder whose name is not UTF-8 (surrogates in Python's str) stopped elsa-evaluate with a
    UnicodeEncodeError at its table where stdout's errors are strict (PYTHONIOENCODING=utf-8; a UTF-8 locale), and a
    Python caller's console printed logging's "Logging error" for each line naming it. Both now write its escape."""
    import io
    import os

    from elsa_ds.log import ConsoleHandler

    odd = tmp_path / os.fsdecode(b"text_\xff")
    odd.mkdir()
    (odd / "a.txt").write_text(sorted(text_dir.glob("*.txt"))[0].read_text())
    proc = run_entry("evaluate.py", ["--model", str(tiny_model_dir), "--ppl", str(odd), "--seqlen", "32", "--limit", "2"],
                     timeout=300, env={"PYTHONIOENCODING": "utf-8"})
    assert "Traceback" not in proc.stderr and "text_\\udcff ppl |" in proc.stdout, proc.stderr[-2000:]
    strict = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    record = logging.LogRecord("elsa_ds.x", logging.WARNING, __file__, 1, f"no room under {odd}", None, None)
    handler = ConsoleHandler(0)
    handler.handleError = lambda r: pytest.fail("logging's 'Logging error'")  # type: ignore[method-assign]
    old = sys.stderr
    sys.stderr = strict
    try:
        handler.emit(record)
    finally:
        sys.stderr = old
    assert strict.buffer.getvalue().decode().endswith("text_\\udcff\n")


def test_a_calls_log_level_leaves_the_callers_environment_and_oneshot_shows_its_parameters(monkeypatch):
    """An audit of the API in a long-lived process: a call with ``log_level`` left HF_HUB_DISABLE_PROGRESS_BARS set
    for the rest of the process; ``elsa_ds.oneshot`` (a package made callable) showed ``(*args, **kwargs)``."""
    import inspect
    import os

    import elsa_ds
    from elsa_ds.log import QUIET_ENV, logging_for

    for name in QUIET_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the caller's own value stays theirs
    with logging_for("warning"):
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "true"
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ and os.environ["TOKENIZERS_PARALLELISM"] == "true"
    assert list(inspect.signature(elsa_ds.oneshot).parameters)[:3] == ["model", "method", "dataset"]
