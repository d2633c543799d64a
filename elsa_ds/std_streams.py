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

import sys
from typing import Any, TextIO

_LOST: dict[str, str] = {}  # stream name -> the error that made it drop its writes


class SteadyStream:
    """``stream`` (sys.stdout or sys.stderr, ``name``) until a write or a flush fails with an OSError; then nothing is
    written there, once said on the other stream. Everything else (``fileno``, ``isatty``, ``encoding``, ``buffer``) is
    the stream's own."""

    def __init__(self, stream: TextIO, name: str):
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        if self._name not in _LOST:
            try:
                return self._stream.write(text)
            except OSError as err:
                self._lose(err)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._name not in _LOST:
            try:
                self._stream.flush()
            except OSError as err:
                self._lose(err)

    def _lose(self, err: OSError) -> None:
        _LOST[self._name] = str(err)
        other = "stderr" if self._name == "stdout" else "stdout"
        if other in _LOST or (stream := getattr(sys, other, None)) is None:  # closed too (2>&-: None): nowhere to say it
            return
        try:
            stream.write(f"elsa_ds: warning: the standard {'output' if self._name == 'stdout' else 'error'} cannot be "
                         f"written ({err}): the command goes on without it, and ends with exit code 120 where it would "
                         "end with 0\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - a warning must never be what stops the job
            pass

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._stream, attr)


def install() -> None:
    """sys.stdout and sys.stderr as :class:`SteadyStream` (once; a stream that is None, as under pythonw, is left)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SteadyStream):
            setattr(sys, name, SteadyStream(stream, name))


def lost() -> dict[str, str]:
    """The standard streams whose writes were dropped, each with the error that made it so."""
    return dict(_LOST)
