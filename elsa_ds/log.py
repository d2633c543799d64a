"""The project's console: ``logging`` with rank-zero output, one ``--log_level``, and the library warnings a user
cannot act on filtered.

    log = get_logger(__name__)
    log.info("pruning %d layers", n)          # rank 0:  [elsa_ds] pruning 7 layers           (stdout)
    log.warning("c4 gave %d windows", 12)     # rank 0:  elsa_ds: warning: c4 gave 12 windows (stderr)
                                              # rank 1:  elsa_ds: warning (rank 1): ...       (stderr)

Rank 0 logs at the chosen level; other ranks log warnings and errors only (a record with ``extra=EVERY_RANK`` is
shown by every rank). Records below WARNING go to stdout, the rest to stderr, both looked up when a record is
written (so a redirected or captured stream is honoured). A command's console is the process's own; in a Python
program (the API, before any command set one up) a record goes instead to the program's own logging where it has set
some up (handlers on the root logger), as a propagated record would, and is written once. What stdout is the product
of a command (the estimate table and JSON, evaluation tables, the flag table) is printed, not logged. The lowest
layer: stdlib only.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

from elsa_ds import launch_env, std_streams

ROOT = "elsa_ds"
PREFIX = "[elsa_ds] "
LogLevel = Literal["debug", "info", "warning", "error"]  # the --log_level choices
EVERY_RANK = {"every_rank": True}  # extra= of a record every rank shows (e.g. "rank 1: nothing to do here")
LIBRARIES = ("DeepSpeed", "deepspeed", "transformers", "datasets", "lm_eval", "accelerate")

# Warnings raised inside libraries about their own use of other libraries: (category, message regex, why the user
# cannot act on it). Each is matched by its category and the start of its message, nothing broader.
QUIET_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (FutureWarning, r"`gradient_checkpointing_enable` is deprecated",
     "transformers 5 renamed the method; elsa_ds calls it on any transformers version, the behaviour is the same"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     "DeepSpeed's ZeRO-3 gathers and reduce-scatters call it, once per collective kind and rank"),
    (UserWarning, r"TypedStorage is deprecated",
     "DeepSpeed's checkpoint and partition code calls tensor.storage(); nothing of the user's touches storages"),
)
# DeepSpeed log records that are a consequence of how elsa_ds builds the engine, not of anything the user chose.
QUIET_LIBRARY_RECORDS: tuple[tuple[str, str, str], ...] = (
    ("DeepSpeed", "You are using ZeRO with an untested optimizer",
     "the ADMM wrapper is the optimizer by design (zero_allow_untested_optimizer); tests hold it to a reference"),
)


QUIET_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # set unless the user set them


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (pass ``__name__``), below the ``elsa_ds`` logger that setup_logging configures.

    Until setup_logging runs (the Python API, tests), a default console is installed: rank from $RANK, level info.
    """
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, ConsoleHandler) for h in root.handlers):
        _configure(root, logging.INFO, launch_env.rank(), command=False)
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def setup_logging(level: str | int = "info", rank: int | None = None, command: bool = True) -> logging.Logger:
    """Console for this process: rank 0 at ``level``, other ranks warnings only; quiet libraries, filtered warnings.

    ``rank`` defaults to $RANK (set by the deepspeed launcher and torchrun). Safe to call again (e.g. per job).
    ``command=False`` (the Python API): the caller's own logging, where it has some, takes the records instead.
    """
    numeric = level if isinstance(level, int) else logging.getLevelName(str(level).upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level {level!r}: use one of {', '.join(get_args(LogLevel))}")
    rank = launch_env.rank() if rank is None else rank
    root = logging.getLogger(ROOT)
    _configure(root, numeric, rank, command)
    quiet_libraries(max(numeric, logging.WARNING))
    filter_warnings()
    return root


@contextmanager
def logging_for(level: str | int) -> Iterator[logging.Logger]:
    """:func:`setup_logging` at ``level`` for a block, and everything it set put back after it (the Python API: the
    caller's program keeps its own elsa_ds level and handlers, library levels and filters, and warning filters)."""
    root = logging.getLogger(ROOT)
    libraries = [logging.getLogger(n) for n in {*LIBRARIES, *(name for name, _m, _w in QUIET_LIBRARY_RECORDS)}]
    saved = (list(root.handlers), root.level, root.propagate, [(lib, lib.level, list(lib.filters)) for lib in libraries])
    # the warning filters and QUIET_ENV (an audit: left set in the caller's environment), restored on leaving
    with warnings.catch_warnings(), launch_env.environ_restored(QUIET_ENV):
        try:
            yield setup_logging(level, command=False)
        finally:
            handlers, root.level, root.propagate, levels = saved
            root.handlers[:] = handlers
            for lib, lib_level, filters in levels:
                lib.setLevel(lib_level)
                lib.filters[:] = filters


def _configure(root: logging.Logger, level: int, rank: int, command: bool) -> None:
    for handler in [h for h in root.handlers if isinstance(h, ConsoleHandler)]:
        root.removeHandler(handler)
    root.addHandler(ConsoleHandler(rank, yields=not command))
    root.setLevel(level)
    # not propagated: a library's handlers on the root logger would print a command's lines twice; a Python program's
    # own handlers there get the records from the console itself (ConsoleHandler.yields)
    root.propagate = False


class ConsoleHandler(logging.Handler):
    """stdout below WARNING, stderr from WARNING on; rank 0 everything it is given, other ranks WARNING and above.

    ``yields`` (the Python API and the default console): where the program has handlers of its own on the root logger,
    each record is handed to those (at their levels, as propagation would) and not written here (an audit: a program's
    ``logging.basicConfig(filename=...)`` got no elsa_ds line, all of them went to the console only).
    """

    def __init__(self, rank: int, yields: bool = False):
        super().__init__()
        self.rank = rank
        self.yields = yields
        self.lost: dict[str, str] = {}  # stream name -> the error its write raised: nothing more is written there

    def filter(self, record: logging.LogRecord) -> bool:
        shown = self.rank == 0 or record.levelno >= logging.WARNING or getattr(record, "every_rank", False)
        return shown and super().filter(record)

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            kind = record.levelname.lower()
            return f"elsa_ds: {kind}: {text}" if self.rank == 0 else f"elsa_ds: {kind} (rank {self.rank}): {text}"
        return PREFIX + text if self.rank == 0 else f"{PREFIX}rank {self.rank}: {text}"

    def emit(self, record: logging.LogRecord) -> None:
        if self.yields and (program := _programs_handlers()):
            for handler in program:
                if record.levelno >= handler.level:
                    handler.handle(record)
            return
        name = "stderr" if record.levelno >= logging.WARNING else "stdout"
        stream = getattr(sys, name)
        if stream is None or name in self.lost:  # closed when the process started (pythonw, >&-): as print's None
            return
        try:
            line = self.format(record) + "\n"
            try:
                stream.write(line)
            except UnicodeEncodeError:  # a path that is not UTF-8 (or a symbol) to a caller's console of strict encoding
                encoding = getattr(stream, "encoding", None) or "utf-8"
                stream.write(line.encode(encoding, "backslashreplace").decode(encoding))
            stream.flush()
        except OSError as err:  # a Python caller's console on a full disk or a closed pipe (a command's never raises)
            self._lose(name, err)
        except Exception:  # logging's contract: a broken console never raises into the job
            self.handleError(record)

    def _lose(self, name: str, err: OSError) -> None:
        """Say once on the other stream that ``name`` cannot be written, then write nothing more there: logging's own
        handleError printed a 30-line "Logging error" for each record (an audit: elsa_ds.oneshot from a script whose
        stdout went to a full disk)."""
        self.lost[name] = str(err)
        if (again := std_streams.say_lost(name, err, "the job's log lines that go there are dropped", self.lost)) is not None:
            self.lost["stdout" if name == "stderr" else "stderr"] = str(again)  # closed or broken too: nothing more there


def _programs_handlers() -> list[logging.Handler]:
    """The handlers a Python program set up on the root logger, less those it also put on the elsa_ds logger itself
    (pytest's capture is on both): those already have the record."""
    ours = logging.getLogger(ROOT).handlers
    return [h for h in logging.getLogger().handlers if h not in ours]


def quiet_libraries(level: int = logging.WARNING) -> None:
    """Libraries log at WARNING or above; their progress bars and tokenizer threads stay off."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(level)
    for name, message, _why in QUIET_LIBRARY_RECORDS:
        library = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.message == message for f in library.filters):
            library.addFilter(_DropMessage(message))


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return self.message not in record.getMessage()


@contextmanager
def warnings_filtered() -> Iterator[None]:
    """The QUIET_WARNINGS ignored for a block, the caller's warning filters put back after it (the Python API: a
    walk saw DeepSpeed's deprecation warnings there, which the command line filters)."""
    with warnings.catch_warnings():
        filter_warnings()
        yield


def filter_warnings() -> None:
    """Ignore exactly the QUIET_WARNINGS; every other warning is shown as Python shows it."""
    for category, message, _why in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
