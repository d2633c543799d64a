"""The house rules as functions over a source tree (``root`` holds ``elsa_ds/``, ``launch/``, ``bench/``).

Each check returns the violations it found, one readable line each (empty: the rule holds), so that
``tests/test_structure.py`` can run it on the real tree and on a temporary copy with a planted violation.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

SCANNED = ("elsa_ds", "launch", "bench")

# The rooms of elsa_ds (the names under it, module or package), layer by layer, each layer in order. A room may
# import its own modules (import_cycles keeps those acyclic), any room of a lower layer, and the rooms listed before it
# in its own layer: never one listed after it, never a higher layer. So the table is the design's reading order, and
# no cycle can form between rooms.
LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: leaves. The standard streams a command keeps writable (std_streams, below errors), how a refusal quotes a value
    # and a pydantic error and stays one line (quoting, below errors), the launcher's variables (launch_env: the rank
    # the logger and the error path name), a file handed over opened
    # without waiting (regular_file, below json_data and every reader of files), pure math (admm, the training loss and
    # its Triton kernel below it), the method names, which weights are pruned (targets), and the evaluation's
    # measures: perplexity over windows, sparsity read from files, zero-shot accuracy (their runner is
    # jobs/evaluate.py); torch's underscored APIs (torch_api) below the math that calls them, and Triton's import
    # (triton_api) below the kernels that use it.
    ("std_streams", "quoting", "launch_env", "errors", "version", "log", "regular_file", "json_data", "methods", "torch_api",
     "triton_api", "admm", "loss_kernel", "loss", "targets", "evaluation"),
    # 1: plain data: the text corpora; the files a job reads and writes (formats, atomic writes, ownership, the output
    # folder); the settings a user gives (settings models, options, config files, the defaults rule, the flags).
    ("data", "files", "settings"),
    # 2: components: model loading, the retraining's adapters, the DeepSpeed adapter (zero scores its engine with
    # evaluation.perplexity's window_nll, so the run's validation perplexity is the evaluator's protocol by
    # construction), the one-shot methods, the sparse checkpoint, the single-process reference, the monitor and the
    # step profile (where a job's step time goes).
    ("models", "finetune", "monitor", "step_profile", "zero", "oneshot", "sparse", "reference"),
    # 3: before a job starts: what a machine can hold and run (capacity), then the finished plan it feeds.
    ("capacity", "plan"),
    # 4: the jobs (the pruning jobs, the evaluation runner).
    ("jobs",),
    # 5: the surfaces a user calls.
    ("demo", "cli", "api", "__init__"),
)
RANK: dict[str, tuple[int, int]] = {name: (layer, i) for layer, names in enumerate(LAYERS) for i, name in enumerate(names)}
OUTSIDE_LAYER = 6  # launch/ and bench/: may import anything in elsa_ds; elsa_ds never imports them
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
MAX_LINE_CHARS = 140
PRIVATE_OWNERS = ("torch", "deepspeed")  # whose private names only the adapter may touch
# the DeepSpeed adapter (torch's internals around ZeRO-3 too), and torch's documented-beta underscored APIs the math core
# and the benches call (multi-tensor ops, the compiler's switches): never DeepSpeed's from the core
PRIVATE_ACCESS_ALLOWED = ("elsa_ds/zero/compat.py", "elsa_ds/torch_api.py")


def python_files(root: Path, tops: tuple[str, ...] = SCANNED) -> list[Path]:
    return [p for top in tops if (root / top).is_dir() for p in sorted((root / top).rglob("*.py"))]


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def room_of(module: str) -> str:
    """The room of a dotted module name: ``elsa_ds.zero.engine`` -> ``zero``, ``elsa_ds`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rank_of(module: str) -> tuple[int, int] | None:
    """(layer, place in its layer) of a dotted module name; launch/ and bench/ are above every layer; None: no room."""
    if module.split(".")[0] != "elsa_ds":
        return (OUTSIDE_LAYER, 0)
    return RANK.get(room_of(module))


def layer_of(module: str) -> int | None:
    """Layer of a dotted module name (``elsa_ds.zero.engine`` -> the layer of ``zero``); None when it has none."""
    rank = rank_of(module)
    return None if rank is None else rank[0]


def parse(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as e:
        raise AssertionError(f"{path}:{e.lineno}: does not parse: {e.msg}") from e


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(name: str, importer: str, known: set[str]) -> str | None:
    """The longest known module ``name`` refers to; a bare name in launch/ or bench/ may be a sibling on sys.path."""
    for candidate in (name, f"{importer.rpartition('.')[0]}.{name}"):
        parts = candidate.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                return ".".join(parts[:n])
        if importer.startswith("elsa_ds"):
            break
    return None


def imports_of(path: Path, module: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, at any depth (function-level imports included)."""
    found = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module, path).split(".")
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found += [(target, node.lineno) for target in (_resolve(n, module, known) for n in names) if target is not None]
    return found


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of its first import}, over every scanned module."""
    files = {module_name(root, p): p for p in python_files(root)}
    known = set(files)
    graph: dict[str, dict[str, str]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        for target, line in imports_of(path, module, known):
            edges.setdefault(target, f"{path.relative_to(root)}:{line}")
    return graph


def upward_imports(root: Path) -> list[str]:
    """Imports of a higher layer or of a room listed later in the same layer, and modules with no room at all."""
    found = []
    for module, edges in import_graph(root).items():
        own = rank_of(module)
        if own is None:
            found.append(f"{module} has no layer: add its name to LAYERS in tests/structure_rules.py where it belongs")
            continue
        for target, where in edges.items():
            theirs = rank_of(target)
            if theirs is None or room_of(target) == room_of(module) and target.startswith("elsa_ds"):
                continue
            if theirs[0] > own[0]:
                found.append(f"{where}: {module} (layer {own[0]}) imports {target} (layer {theirs[0]})")
            elif theirs[0] == own[0] and theirs[1] > own[1]:
                found.append(f"{where}: {module} imports {target}, a room listed after its own in layer {own[0]}: "
                             f"move the code, or reorder LAYERS if the design changed")
    return sorted(found)


def _strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each in discovery order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycle_through(start: str, members: set[str], graph: dict[str, dict[str, str]]) -> list[str]:
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, {})):
                if child == start:
                    back = [node]
                    while back[-1] != start:
                        back.append(parent[back[-1]])
                    return back[::-1] + [start]
                if child in members and child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a cycle but no path back to it was found")


def import_cycles(root: Path) -> list[tuple[frozenset[str], str]]:
    """Every import cycle, at any depth: (the modules of one strongly connected component, one cycle through it
    written as ``a (file:line) -> b (file:line) -> a``)."""
    graph = import_graph(root)
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) == 1 and component[0] not in graph.get(component[0], {}):
            continue
        path = _cycle_through(component[0], set(component), graph)
        steps = [f"{a} ({graph[a][b]})" for a, b in zip(path, path[1:])]
        extra = f" [{len(component)} modules tangled: {', '.join(component)}]" if len(component) > 2 else ""
        cycles.append((frozenset(component), " -> ".join(steps + [path[-1]]) + extra))
    return cycles


def long_lines(root: Path) -> list[str]:
    found = []
    for path in python_files(root):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if len(line) > MAX_LINE_CHARS:
                found.append(f"{path.relative_to(root)}:{number}: {len(line)} characters")
    return found


def long_functions_and_files(root: Path) -> list[str]:
    """Files over 400 lines and functions over 60 in the package and its entry points (bench/ scripts are exempt)."""
    found = []
    for path in python_files(root, ("elsa_ds", "launch")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            found.append(f"{path.relative_to(root)}: {len(text.splitlines())} lines")
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {length} lines")
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id] + parts[::-1] if isinstance(node, ast.Name) else None


def private_accesses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every private torch/DeepSpeed name a file imports or reads through a module it imported:
    ``import torch._dynamo``, ``from torch.x import _y``, ``torch.ops.mkldnn._is_supported()``."""
    owned = lambda name: name.split(".")[0] in PRIVATE_OWNERS  # noqa: E731
    aliases: dict[str, str] = {}  # local name -> the torch/deepspeed module or object it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in (a for a in node.names if owned(a.name)):
                if any(_is_private(part) for part in alias.name.split(".")):
                    found.append((node.lineno, alias.name))
                local = alias.asname or alias.name.split(".")[0]
                aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and owned(node.module):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if any(_is_private(part) for part in name.split(".")):
                    found.append((node.lineno, name))
                aliases[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain = _dotted(node)
            if chain and chain[0] in aliases:
                found.append((node.lineno, ".".join([aliases[chain[0]]] + chain[1:])))
    return sorted(found)


NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public despite the underscore


def _defined_names(trees: list[ast.AST]) -> set[str]:
    """Every name our own code defines or binds: a private attribute outside this set belongs to a library."""
    names = set(NAMEDTUPLE_API)
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(a.asname or a.name.split(".")[0] for a in node.names)
    return names


def private_access_outside_compat(root: Path) -> list[str]:
    """Private torch/DeepSpeed names (:func:`private_accesses`) and private attributes our code never defines
    (``engine._zero3_consolidated_16bit_state_dict()``: another library's internals; the standard library's are
    left alone), outside the adapter."""
    trees = {path: parse(path) for path in python_files(root)}
    ours = _defined_names(list(trees.values()))
    found = []
    for path, tree in trees.items():
        where = path.relative_to(root)
        if where.as_posix() in PRIVATE_ACCESS_ALLOWED:
            continue
        hits = set(private_accesses(tree))
        named = {(line, name.rpartition(".")[2]) for line, name in hits}
        stdlib = {a.asname or a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                  for a in node.names if a.name.split(".")[0] in sys.stdlib_module_names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in ours:
                if (node.lineno, node.attr) not in named and (_dotted(node) or [""])[0] not in stdlib:
                    hits.add((node.lineno, ast.unparse(node)))
        found += [f"{where}:{line}: {name}" for line, name in sorted(hits)]
    return found


def core_imports_beyond_torch(root: Path) -> list[str]:
    """The math core (``admm/``) reads like the paper on plain tensors: no DeepSpeed, no transformers."""
    found = []
    for path in python_files(root, ("elsa_ds/admm",)):
        for node in ast.walk(parse(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(root)}:{node.lineno}: imports {name}" for name in names
                      if name.split(".")[0] in ("deepspeed", "transformers")]
    return found


SWITCH_NAME = re.compile(r"ELSA_DS_[A-Z0-9_]+")
SWITCH_TABLE = "elsa_ds/plan/switches.py"  # its module-level assignments name every switch the package reads


def unlisted_switches(root: Path) -> list[str]:
    """An ``ELSA_DS_*`` variable the package spells that the switch table does not list: a switch whose values nobody
    checks before a job's work (read late, a wrong value taken for the default: an audit, 2026-12-06)."""
    table = parse(root / SWITCH_TABLE)
    listed = {n.value for a in table.body if isinstance(a, (ast.Assign, ast.AnnAssign)) for n in ast.walk(a)
              if isinstance(n, ast.Constant) and isinstance(n.value, str) and SWITCH_NAME.fullmatch(n.value)}
    found = []
    for path in python_files(root, ("elsa_ds",)):
        found += [f"{path.relative_to(root)}:{n.lineno}: {n.value}" for n in ast.walk(parse(path))
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and SWITCH_NAME.fullmatch(n.value)
                  and n.value not in listed]
    return found
