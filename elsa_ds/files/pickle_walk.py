"""One pickle from elsewhere, read opcode by opcode before anything unpickles it (``pickletools.genops`` builds nothing):
how deep its containers nest, and whether it numbers a memo entry ahead of those it made. Stdlib only.

Why the depth: CPython hashes a tuple by hashing its items, recursively and with no depth guard, so a dict keyed by a
tuple nested a few million deep (3 MB of ``TUPLE1`` opcodes) crashes whatever unpickles it with a segmentation fault,
torch's weights-only loader included, which no exception handler or exit path sees (a fifth audit, 2026-12-06: a
crafted ``pytorch_model.bin`` killed ``elsa-prune`` with no word and left its output's lock). ``torch.save`` nests a
model's or an optimizer's state ~10 deep.
"""
from __future__ import annotations

import pickletools
from typing import BinaryIO, NamedTuple

MAX_NESTING = 1000  # containers inside containers: torch.save's pickles nest ~10 deep, a crash needs ~10^5-10^6
MEMO_OPCODES = ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")  # the opcodes that store into a pickle's memo
GET_OPCODES = ("GET", "BINGET", "LONG_BINGET")
# the opcodes that add to the object below their arguments (a list, dict, set, or any object's state): it keeps its
# identity (the memo's reference to it sees what it gained)
INTO = ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD")


class Walk(NamedTuple):
    """What :func:`walk` read of one pickle: the deepest nesting it builds (past ``MAX_NESTING`` the walk stops there),
    and whether it numbers a memo entry ahead of those made before it (no pickler does; Python's C unpickler sizes its
    memo by the number: 5 bytes ask for 2^26 entries, ~1 GB)."""

    depth: int
    memo_ahead: bool


def walk(stream: BinaryIO) -> Walk:
    """Read one pickle from ``stream`` to its STOP (ValueError from pickletools when it ends early or is no pickle).

    Each value on the modelled stack is a one-item list holding its depth (0 for anything made of no other value), shared
    by every reference to it (the memo, ``DUP``), so a container filled after it was memoized is as deep as it became. A
    container filled after another took it in is not re-counted in the other (no pickler writes that; only lists, dicts
    and objects can be filled, and CPython's hash, the unguarded recursion, stops at the first of those)."""
    stack: list[list[int] | None] = []  # None: a MARK
    memo: dict[int, list[int]] = {}
    made, ahead, deepest = 0, False, 0
    for opcode, arg, _ in pickletools.genops(stream):
        name = opcode.name
        if name == "STOP":
            break
        if name == "MARK":
            stack.append(None)
        elif name in MEMO_OPCODES:
            ahead |= isinstance(arg, int) and arg > made  # MEMOIZE has none
            # MEMOIZE stores at len(memo), as the unpickler does: a PUT that skipped a slot makes that differ from ``made``
            memo[len(memo) if name == "MEMOIZE" else int(arg or 0)] = (stack[-1] if stack and stack[-1] is not None else LEAF)
            made += 1
        elif name in GET_OPCODES:
            stack.append(memo.get(int(arg or 0), LEAF))
        elif name in FILLABLE:  # an empty list, dict or set: a value of its own, which APPEND and the like make deeper
            stack.append([0])
        elif name in LEAVES:  # a value made of nothing that nothing fills (a number, a string): the most of them, one cell
            stack.append(LEAF)
        elif name == "POP":  # the top value (or MARK) dropped: the second most common in a crafted stream of many values
            if stack:
                stack.pop()
        elif (depth := _apply(name, stack)) > deepest:
            deepest = depth
            if deepest > MAX_NESTING:
                break
    return Walk(deepest, ahead)


class _Moves(NamedTuple):
    """How an opcode moves values: whether it takes the values above a MARK (and the MARK), how many it takes below the
    MARK (or in all, without one), how many it pushes, and whether it fills the lowest one taken (:data:`INTO`)."""

    marked: bool
    fixed: int
    pushed: int
    into: bool


def _moves(op: pickletools.OpcodeInfo) -> _Moves:
    before = op.stack_before
    marked = pickletools.markobject in before
    return _Moves(marked, before.index(pickletools.markobject) if marked else len(before), len(op.stack_after), op.name in INTO)


MOVES = {op.name: _moves(op) for op in pickletools.opcodes}
FILLABLE = ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET")
# the values made of nothing that nothing fills (a number, a string, a global): the walk's own cases (MARK, the memo's
# GETs, the fillable empties) apart
LEAVES = frozenset(name for name, moves in MOVES.items() if not moves.marked and moves.fixed == 0 and moves.pushed == 1
                   and name not in ("MARK", *GET_OPCODES, *FILLABLE))
LEAF = [0]  # the one cell of every leaf (16 MiB of NONE opcodes took 1.45 GB as a cell each, a review found): never filled


def _apply(name: str, stack: list[list[int] | None]) -> int:
    """Opcode ``name`` on the modelled stack, as the unpickler moves values; returns the depth of what it made or filled."""
    moves = MOVES[name]
    taken: list[list[int] | None] = []
    if moves.marked:  # the values down to the MARK, then the MARK
        while stack and stack[-1] is not None:
            taken.append(stack.pop())
        if stack:
            stack.pop()
    lowest = None
    for _ in range(min(moves.fixed, len(stack))):  # those below the MARK (or all): the last taken is the lowest
        lowest = stack.pop()
        taken.append(lowest)
    if moves.into and lowest is not None:
        taken.pop()
        cell = [lowest[0]] if lowest is LEAF else lowest  # a leaf filled (BUILD on a class): a value of its own
        cell[0] = max(cell[0], 1 + max((v[0] for v in taken if v is not None), default=-1))
    else:
        cell = [1 + max((v[0] for v in taken if v is not None), default=-1)]
    stack.extend(cell for _ in range(moves.pushed))  # DUP pushes the same value twice
    return cell[0]
