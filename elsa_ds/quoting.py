"""How a one-line refusal quotes what it refuses: a value cut to a line's length, each problem of a pydantic
ValidationError named by its field, a path as a shell reads it back, and the line itself kept one line. Stdlib only."""
from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from typing import Any


def format_validation_error(err: Any, where: str, model: Any, errors: list | None = None,
                            render: Callable[[Any], str] = repr) -> str:
    """Every problem of a pydantic ValidationError against settings ``model`` in one line, each naming its field
    (``errors``: only these of ``err.errors()``; ``render``: how a value is shown, :func:`as_json` for a file's)."""
    known = ", ".join(sorted(model.model_fields))
    parts = pydantic_problems(err.errors() if errors is None else errors, ".".join,
                              lambda field: f"{field}: unknown setting (known: {known})", render)
    return f"invalid setting in {where}: " + "; ".join(parts)


def pydantic_problems(errors: list, name: Callable[[tuple[str, ...]], str], unknown: Callable[[str], str],
                      render: Callable[[Any], str] = repr, limit: int = 300) -> list[str]:
    """Each of a pydantic ValidationError's ``errors`` as a phrase: a rule across fields as its message (after
    ``name(())``, its model's name, where that is not empty), a key the model does not know as ``unknown(name)``, else
    ``name=value: message``, the field named by ``name(loc)`` and its value by :func:`shown` (``render``, ``limit``)."""
    parts = []
    for e in errors:
        loc = tuple(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:  # a rule across fields: the message names them (``name(())`` their model, if anything)
            parts.append(f"{label}: {msg}" if (label := name(loc)) else msg)
        elif e["type"] == "extra_forbidden":
            parts.append(unknown(name(loc)))
        else:
            parts.append(f"{name(loc)}={shown(e.get('input'), limit, render)}: {msg}")
    return parts


def as_json(value: Any) -> str:
    """A JSON file's value as the file spells it (``true``, ``"false"``), where repr would show Python's ``True``, ``'false'``;
    a value elsa_ds put there as Python shows it."""
    return json.dumps(value, default=repr)


def shown(value: Any, limit: int = 300, render: Callable[[Any], str] = repr) -> str:
    """A refused value as a line quotes it: ``render(value)`` (repr; json.dumps for a JSON file's value), its middle cut
    past ``limit`` characters (a 10,000-digit --steps was quoted whole; past 4,300 digits repr itself raises), the end
    kept (a path's last names say what is wrong)."""
    try:
        text = render(value)
    except ValueError:
        return f"<a {type(value).__name__} too long to show>"
    return text if len(text) <= limit else f"{text[:limit * 2 // 3]}...{text[-(limit // 5):]} ({len(text):,} characters)"


# every character str.splitlines() ends a line at, and the other control characters, as Python's repr escapes them
_ESCAPED = {c: repr(chr(c))[1:-1] for c in (*range(32), 127, 0x85, 0x2028, 0x2029)}


def one_line(text: str) -> str:
    """``text`` with its line breaks and other control characters escaped as repr escapes them (``\\n``, ``\\x1b``): a
    refusal stays the one line it promises when a path it names holds a newline (an audit: ``--deepspeed
    $'no\\nsuch.json'`` split it in two; so did a terminal's escape sequences)."""
    return text.translate(_ESCAPED)


def shell_word(text: str) -> str:
    """``text`` as one word a shell reads back as it is: shlex's quoting, or where it holds a control character or bytes
    that are not UTF-8 (a path's), ``$'...'`` (bash, zsh; POSIX since 2024) with those escaped (``\\n``, ``\\xff``). A suggested ``mv``
    stays one line that names the right path (shlex kept the newline, and the one-line rule then changed the path)."""
    if text.isprintable():
        return shlex.quote(text)
    out = []
    for ch in text:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:  # its bytes: a control character's UTF-8, a surrogate escape's one undecodable byte (another surrogate's own)
            try:
                data = os.fsencode(ch)
            except UnicodeEncodeError:
                data = ch.encode("utf-8", "surrogatepass")
            out.extend(f"\\x{b:02x}" for b in data)
    return "$'" + "".join(out) + "'"
