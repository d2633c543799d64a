"""The house rules that keep the code readable, checked on the source: small functions and files, imports that
only run downward through the layers, and a README flag table generated from the settings it documents."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "elsa_ds"

# A module may import from its own layer or a lower one, never from a higher one.
LAYERS: dict[str, int] = {
    "errors": 0, "version": 0, "methods": 0, "admm": 0,
    "config": 1, "config_files": 1, "targets": 1, "mask_file": 1, "io": 1,
    "data": 1,  # text sources, sampling and windows depend on nothing of ours but errors; config names their enums
    "models": 2, "zero": 2, "oneshot": 2, "evaluation": 2, "output": 2, "memory": 2, "monitor": 2,
    "reference": 2, "ablation": 2, "shapes": 2, "safetensors_writer": 1, "finetune": 2, "defaults": 2, "preflight": 2,
    "jobs": 3,
    "api": 4, "cli": 4, "__init__": 4, "demo": 4,
}
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layer(module: str) -> int:
    """Layer of a dotted module name inside elsa_ds (``elsa_ds.zero.engine`` -> the layer of ``zero``)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top not in LAYERS:
        raise AssertionError(f"elsa_ds.{top} has no layer in tests/test_structure.py: LAYERS; add it where it belongs")
    return LAYERS[top]


def _imports(tree: ast.AST, module: str) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else ".".join(module.split(".")[:-node.level] + [node.module])
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names if base == "elsa_ds"]
    return [m for m in found if m.startswith("elsa_ds")]


def _name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in _modules():
        module = _name(path)
        own = LAYERS["__init__"] if module == "elsa_ds" else _layer(module)
        for target in _imports(ast.parse(path.read_text()), module):
            if target != "elsa_ds" and _layer(target) > own:
                upward.append(f"{module} (layer {own}) imports {target} (layer {_layer(target)})")
    assert not upward, "\n".join(upward)


def test_functions_and_files_are_small():
    long = []
    for path in _modules():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)


def test_readme_flag_table_is_generated_from_the_settings():
    from elsa_ds.cli import flag_table

    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- flags:start (python -m elsa_ds.cli --flag-table) -->\n", "<!-- flags:end -->"
    assert start in readme and end in readme, "the README's flag table markers are missing"
    table = readme[readme.index(start) + len(start):readme.index(end)]
    assert table == flag_table(), "README flag table is stale: regenerate it with python -m elsa_ds.cli --flag-table"


@pytest.mark.parametrize("flag", ["--sparsity", "--lmda", "--deepspeed", "--output_dir", "--betas", "--gradient_checkpointing"])
def test_every_setting_has_exactly_one_flag(flag):
    from elsa_ds.cli import prune_parser

    parser = prune_parser()
    assert sum(flag in action.option_strings for action in parser._actions) == 1
    assert next(a for a in parser._actions if flag in a.option_strings).help
