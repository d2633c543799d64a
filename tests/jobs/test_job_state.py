"""The jobs' state is explicit and the jobs share code by composition (``elsa_ds/jobs/interface.py``), read from the source
with ``ast``:

1. declared state: every ``self.X`` a class in ``elsa_ds/jobs/`` stores anywhere (any method, nested functions included;
   ``X = ``, ``+=``, annotated, tuple targets, ``for``/``with`` targets) is also stored by its ``__init__`` (a dataclass:
   declared as a field, or stored by ``__post_init__``); ``setattr(self, ...)`` outside ``__init__`` is refused outright.
2. typed state: the first store of each attribute in ``__init__`` carries an annotation, or copies the ``__init__``
   parameter of the same name, which is annotated.
3. nothing left for setup to fill: no attribute is declared ``X | None`` (or ``Optional[X]``) as None in ``__init__`` and
   stored again by another method; what setup builds, it returns.
4. no job inheritance: no class in ``elsa_ds/jobs/`` has a base that is a class defined in ``elsa_ds/jobs/`` (by name),
   except a ``Protocol`` there (an interface: its methods may hold only a docstring, ``...`` or ``pass``). Bases from
   outside (``object``, ``Protocol``, library classes) are allowed.

Each check runs on the real package and, to show it can fail, on a planted violation parsed by the same checker.
"""
from __future__ import annotations

import ast
from pathlib import Path

JOBS = Path(__file__).resolve().parents[2] / "elsa_ds" / "jobs"
STUB = (ast.Pass, ast.Expr)  # an Expr statement here is a docstring or ``...``


def _classes(tree: ast.AST) -> list[ast.ClassDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _is_dataclass(cls: ast.ClassDef) -> bool:
    names = [d.func if isinstance(d, ast.Call) else d for d in cls.decorator_list]
    return any((n.id if isinstance(n, ast.Name) else getattr(n, "attr", "")) == "dataclass" for n in names)


def _self_name(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    args = fn.args.posonlyargs + fn.args.args
    return args[0].arg if args else None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        found = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        found = [node.optional_vars]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found.extend(t.elts)
        elif isinstance(t, ast.Starred):
            found.append(t.value)
        else:
            flat.append(t)
    return flat


def _stores(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, ast.AST]]:
    """(attribute, statement) for every ``self.X`` the method stores, in source order."""
    me = _self_name(fn)
    found = []
    for node in ast.walk(fn):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                found.append((t.attr, node))
    return sorted(found, key=lambda item: (item[1].lineno, item[1].col_offset))


def _setattr_on_self(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[int]:
    me = _self_name(fn)
    return [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == "setattr" and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == me]


def _declared(cls: ast.ClassDef) -> set[str]:
    methods = _methods(cls)
    init = {name for name, _ in _stores(methods["__init__"])} if "__init__" in methods else set()
    if _is_dataclass(cls):
        init |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        if "__post_init__" in methods:
            init |= {name for name, _ in _stores(methods["__post_init__"])}
    return init


def undeclared_attributes(source: str) -> list[str]:
    """``Class.method: self.X`` for every attribute stored outside ``__init__`` that ``__init__`` does not store."""
    problems = []
    for cls in _classes(ast.parse(source)):
        declared = _declared(cls)
        for name, fn in _methods(cls).items():
            if name == "__init__":
                continue
            problems += [f"{cls.name}.{name}: self.{attr} (line {node.lineno})" for attr, node in _stores(fn) if attr not in declared]
            problems += [f"{cls.name}.{name}: setattr(self, ...) (line {line})" for line in _setattr_on_self(fn)]
    return problems


def untyped_attributes(source: str) -> list[str]:
    """``Class.X`` for every attribute whose first store in ``__init__`` has no annotation and copies no annotated parameter."""
    problems = []
    for cls in _classes(ast.parse(source)):
        init = _methods(cls).get("__init__")
        if init is None:
            continue
        typed_params = {a.arg for a in init.args.posonlyargs + init.args.args + init.args.kwonlyargs if a.annotation is not None}
        seen: set[str] = set()
        for attr, node in _stores(init):
            if attr in seen:
                continue
            seen.add(attr)
            copies_param = (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Name)
                            and node.value.id == attr and attr in typed_params)
            if not isinstance(node, ast.AnnAssign) and not copies_param:
                problems.append(f"{cls.name}.{attr} (line {node.lineno})")
    return problems


def _optional(annotation: ast.expr | None) -> bool:
    """``X | None``, ``None | X`` or ``Optional[X]``."""
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return any(isinstance(side, ast.Constant) and side.value is None or _optional(side)
                   for side in (annotation.left, annotation.right))
    return isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", getattr(annotation.value, "attr", "")) == "Optional"


def filled_later(source: str) -> list[str]:
    """``Class.X`` for every attribute ``__init__`` declares ``X | None = None`` that another method stores."""
    problems = []
    for cls in _classes(ast.parse(source)):
        methods = _methods(cls)
        if "__init__" not in methods:
            continue
        empty = {attr for attr, node in _stores(methods["__init__"]) if isinstance(node, ast.AnnAssign)
                 and _optional(node.annotation) and isinstance(node.value, ast.Constant) and node.value.value is None}
        later = {attr for name, fn in methods.items() if name != "__init__" for attr, _ in _stores(fn)}
        problems += [f"{cls.name}.{attr}" for attr in sorted(empty & later)]
    return problems


def _base_name(base: ast.expr) -> str:
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        return base.attr
    return base.id if isinstance(base, ast.Name) else ""


def _is_protocol(cls: ast.ClassDef) -> bool:
    return any(_base_name(b) == "Protocol" for b in cls.bases)


def job_inheritance(sources: dict[str, str]) -> list[str]:
    """``Class(Base)`` for every class of ``sources`` (module -> text) whose base is a non-Protocol class defined in them,
    and ``Protocol.method`` for every interface method with a body."""
    classes = {cls.name: cls for text in sources.values() for cls in _classes(ast.parse(text))}
    problems = []
    for cls in classes.values():
        for base in map(_base_name, cls.bases):
            if base in classes and not _is_protocol(classes[base]):
                problems.append(f"{cls.name}({base})")
        if _is_protocol(cls):
            problems += [f"{cls.name}.{name} has a body" for name, fn in _methods(cls).items()
                         if not all(isinstance(s, STUB) for s in fn.body)]
    return problems


def _package() -> dict[str, str]:
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(JOBS.glob("*.py"))}


# ---- the package ----------------------------------------------------------------------------------------------------
def test_the_checks_see_every_job():
    names = {cls.name for text in _package().values() for cls in _classes(ast.parse(text))}
    assert {"ElsaJob", "FinetuneJob", "OneShotJob", "Job", "ReportRecord", "Checkpoints"} <= names


def test_every_job_attribute_is_declared_in_init():
    assert [f"{m}: {p}" for m, text in _package().items() for p in undeclared_attributes(text)] == []


def test_every_job_attribute_is_typed_in_init():
    assert [f"{m}: {p}" for m, text in _package().items() for p in untyped_attributes(text)] == []


def test_no_job_attribute_is_none_until_setup():
    assert [f"{m}: {p}" for m, text in _package().items() for p in filled_later(text)] == []


def test_no_job_inherits_from_another():
    assert job_inheritance(_package()) == []


# ---- planted violations: each check can fail ----------------------------------------------------------------------
PLANTED_STATE = '''
from dataclasses import dataclass

class Late:
    def __init__(self, cfg: int):
        self.cfg = cfg
        self.a: int = 0

    def setup(self):
        self.a, self.b = 1, 2          # b: not declared
        self.cfg += 1                  # declared: fine
        for self.c in range(3):        # c: not declared
            pass

    def train(self):
        def inner():
            self.d = 4                 # d: not declared, inside a nested function
        setattr(self, "e", 5)          # refused outright
        return inner

@dataclass
class Record:
    x: int = 0

    def fill(self):
        self.x = 1                     # a field: fine
        self.y = 2                     # y: not declared
'''


def test_planted_undeclared_attributes_are_found():
    found = undeclared_attributes(PLANTED_STATE)
    assert [p.split(" (line")[0] for p in found] == [
        "Late.setup: self.b", "Late.setup: self.c", "Late.train: self.d", "Late.train: setattr(self, ...)", "Record.fill: self.y"]


def test_planted_untyped_attributes_are_found():
    planted = '''
class Untyped:
    def __init__(self, cfg: int, opts, rank: int):
        self.cfg = cfg                  # copies an annotated parameter: fine
        self.opts = opts                # the parameter has no annotation
        self.world = rank + 1           # computed, no annotation
        self.rank: int = rank
        self.rank = 2                   # a later store: the first one counts
'''
    assert [p.split(" (line")[0] for p in untyped_attributes(planted)] == ["Untyped.opts", "Untyped.world"]


def test_planted_job_inheritance_is_found():
    planted = {
        "interface": "from typing import Protocol\nclass Job(Protocol):\n    def setup(self) -> None: ...\n",
        "elsa": "class ElsaJob:\n    def setup(self):\n        pass\n",
        "finetune": "from elsa_ds.jobs.elsa import ElsaJob\nclass FinetuneJob(ElsaJob):\n    pass\n",
        "oneshot": "from elsa_ds.jobs import interface\nclass OneShotJob(interface.Job):\n    pass\n",  # an interface: fine
        "fat": "from typing import Protocol\nclass Fat(Protocol):\n    def go(self) -> int:\n        return 1\n",
    }
    assert job_inheritance(planted) == ["FinetuneJob(ElsaJob)", "Fat.go has a body"]


def test_planted_attributes_left_for_setup_are_found():
    planted = '''
from typing import Optional

class Job:
    def __init__(self, plan: int):
        self.plan = plan
        self.engine: Engine | None = None       # set by setup: refused
        self.data: Optional[Data] = None        # set by setup: refused
        self.selector: Selector | None = None   # never stored again: a real "none" (e.g. without --select_every)
        self.state: State = State()             # replaced by load_checkpoint, never None: fine

    def setup(self):
        self.engine, self.data = build(), load()
        self.state = State()
'''
    assert filled_later(planted) == ["Job.data", "Job.engine"]
