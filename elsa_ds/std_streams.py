"""A command's standard output and error, kept from ending its job when they cannot be written. Stdlib only.

A pruning job prints as it goes, and so do the libraries under it (DeepSpeed's ``print`` as it loads an op). When the
reader of a pipe has gone (``elsa-prune ... | head``: EPIPE) or the file the output goes to cannot grow (``> /dev/full``,
a full disk: ENOSPC; EIO), each such write raises an OSError wherever it happens: a job then stopped with a traceback,
or with a full disk blamed on its output folder (a fifth audit, 2026-12-06). :func:`install` (the command-line entry
points, through ``errors.run_command``; never a Python caller's own streams) makes the first failed write of either
stream say so once on the other, then drops what is written there, and the job goes on. At its end the command exits
120 instead of 0 (``errors.end_process``): Python's code for output it could not write at exit (Python gives 120 whatever
the code; a failing job keeps its own here, which says more).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

_LOST: dict[str, str] = {}  # stream name -> the error that made it drop its writes
MARK = "std_stream"  # the attribute a MarkedStream sets on the OSError its write raised: the stream's name


class _Proxy:
    """``stream`` (sys.stdout or sys.stderr, ``name``) with its writes and flushes through :meth:`_failed` when they raise
    an OSError, none made while :meth:`_dropping`; everything else (``fileno``, ``isatty``, ``encoding``, ``buffer``)
    the stream's own."""

    def __init__(self, stream: TextIO, name: str):
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        if not self._dropping():
            try:
                return self._stream.write(text)
            except OSError as err:
                self._failed(err)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self._dropping():
            try:
                self._stream.flush()
            except OSError as err:
                self._failed(err)

    def _dropping(self) -> bool:
        return False

    def _failed(self, err: OSError) -> None:
        raise err

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._stream, attr)


class SteadyStream(_Proxy):
    """A command's ``stream`` until a write or a flush fails with an OSError; then nothing is written there, once said
    on the other stream."""

    def _dropping(self) -> bool:
        return self._name in _LOST

    def _failed(self, err: OSError) -> None:
        _LOST[self._name] = str(err)
        say_lost(self._name, err, "the command goes on without it, and ends with exit code 120 where it would end with 0",
                 _LOST)


class MarkedStream(_Proxy):
    """A Python caller's own ``stream``, as it is, except that an OSError its write or flush raises is marked as the
    stream's (its attribute :data:`MARK` set to ``name``) on its way out: a job that stops on it then names the stream,
    not its output folder (an audit: a print to a full disk, ``elsa_ds.prune`` called from a script whose output went
    to a file there, was reported as no space left writing --output_dir)."""

    def _failed(self, err: OSError) -> None:
        setattr(err, MARK, self._name)
        raise err


_MARKING = threading.Lock()
_MARKED: dict[str, MarkedStream] = {}  # the streams marked() put in place, while any job inside it runs
_MARKED_JOBS = [0]  # how many jobs are inside marked()


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """sys.stdout and sys.stderr as :class:`MarkedStream` inside (not a command's: its :class:`SteadyStream` never
    raises), each put back when the last job inside ends (two jobs in two threads: the first to end left the second's
    streams unmarked), unless the caller replaced it meanwhile. They are the process's: a stream a library keeps from
    inside (a logging handler made there) keeps the mark, which only adds a tag to its errors."""
    with _MARKING:
        if _MARKED_JOBS[0] == 0:
            for name in ("stdout", "stderr"):
                stream = getattr(sys, name)
                if stream is not None and not isinstance(stream, (SteadyStream, MarkedStream)):
                    _MARKED[name] = MarkedStream(stream, name)
                    setattr(sys, name, _MARKED[name])
        _MARKED_JOBS[0] += 1
    try:
        yield
    finally:
        with _MARKING:
            _MARKED_JOBS[0] -= 1
            if _MARKED_JOBS[0] == 0:
                for name, stream in _MARKED.items():
                    if getattr(sys, name) is stream:
                        setattr(sys, name, stream._stream)
                _MARKED.clear()


def say_lost(name: str, err: BaseException, then: str, lost: dict[str, str]) -> BaseException | None:
    """Say on the other standard stream that ``name`` cannot be written (``err``), and ``then`` what follows: not where
    that stream is in ``lost`` or closed (2>&-: None), nowhere to say it. The exception its own write raised, if any (a
    warning must never be what stops the job)."""
    other = "stderr" if name == "stdout" else "stdout"
    if other in lost or (stream := getattr(sys, other, None)) is None:
        return None
    try:
        stream.write(f"elsa_ds: warning: the standard {'output' if name == 'stdout' else 'error'} cannot be written "
                     f"({err}): {then}\n")
        stream.flush()
    except Exception as again:  # noqa: BLE001
        return again
    return None


def install() -> None:
    """sys.stdout and sys.stderr as :class:`SteadyStream` (once), after :func:`reopen_closed`; a character their
    encoding cannot write is written as its escape (a seventh audit: a path that is not UTF-8, ``--ppl $'text_\\xff'``,
    stopped elsa-evaluate with a UnicodeEncodeError at its table where stdout's errors are strict, as under a UTF-8
    locale; stderr's are escapes already)."""
    reopen_closed()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
        if stream is not None and not isinstance(stream, SteadyStream):
            setattr(sys, name, SteadyStream(stream, name))


def reopen_closed() -> None:
    """A standard descriptor closed when the command started (``>&-``, ``2>&-``, ``<&-``: Python leaves its stream None)
    opened on the null device, before a file the job opens takes its number: the output's lock took descriptor 1, where
    a library's C-level write or a child's output would have landed (a sixth audit; DeepSpeed's op build then flushed
    None, a traceback). Its Python stream writes there, as a command's output nobody reads. A number taken already is
    left as it is."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)
            continue  # open again since: a file of the process's own holds the number
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)  # a child's standard descriptor too, as the closed one would have been given
        setattr(sys, name, open(fd, mode, closefd=False, encoding="utf-8", errors="backslashreplace"))


def lost() -> dict[str, str]:
    """The standard streams whose writes were dropped, each with the error that made it so."""
    return dict(_LOST)
