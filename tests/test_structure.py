"""The house rules that keep the code readable, checked on the source: imports that only run downward through
the layers and never in a circle, small functions, files and lines, DeepSpeed's and torch's private names behind
one adapter, and a README flag table generated from the settings it documents.

The rules themselves are functions over a source tree (``tests/structure_rules.py``); the second half of this file
plants one violation of each in a temporary copy of the tree and checks that the rule catches it.
"""
from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from tests import structure_rules as rules

ROOT = Path(__file__).resolve().parent.parent


def _cycles(root: Path) -> list[str]:
    return [path for _, path in rules.import_cycles(root)]


def test_no_module_imports_a_higher_layer():
    assert not (found := rules.upward_imports(ROOT)), "\n".join(found)


def test_no_import_cycles_at_any_depth():
    assert not (found := _cycles(ROOT)), "import cycles:\n" + "\n".join(found)


def test_every_switch_the_package_reads_is_in_the_switch_table():
    assert not (found := rules.unlisted_switches(ROOT)), "add these to elsa_ds/plan/switches.py:\n" + "\n".join(found)


def test_lines_are_at_most_140_characters():
    assert not (found := rules.long_lines(ROOT)), "\n".join(found)


def test_functions_and_files_are_small():
    assert not (found := rules.long_functions_and_files(ROOT)), "\n".join(found)


def test_private_torch_and_deepspeed_names_only_in_the_adapter():
    assert not (found := rules.private_access_outside_compat(ROOT)), (
        "private torch/DeepSpeed access belongs in elsa_ds/zero/compat.py (behind its version check):\n" + "\n".join(found))


def test_the_math_core_imports_neither_deepspeed_nor_transformers():
    assert not (found := rules.core_imports_beyond_torch(ROOT)), "\n".join(found)


def test_readme_flag_table_is_generated_from_the_settings():
    from elsa_ds.cli import flag_table

    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- flags:start (python -m elsa_ds.cli --flag-table) -->\n", "<!-- flags:end -->"
    assert start in readme and end in readme, "the README's flag table markers are missing"
    table = readme[readme.index(start) + len(start):readme.index(end)]
    assert table == flag_table(), "README flag table is stale: regenerate it with python -m elsa_ds.cli --flag-table"


@pytest.mark.parametrize("flag", ["--sparsity", "--lmda", "--deepspeed", "--output_dir", "--betas",
                                  "--gradient_checkpointing"])
def test_every_setting_has_exactly_one_flag(flag):
    from elsa_ds.cli import prune_parser

    parser = prune_parser()
    assert sum(flag in action.option_strings for action in parser._actions) == 1
    assert next(a for a in parser._actions if flag in a.option_strings).help


# ---- each rule catches a planted violation ------------------------------------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the scanned sources (Python files only)."""
    def not_python(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(folder) / n).is_dir())]

    for top in rules.SCANNED:
        shutil.copytree(ROOT / top, tmp_path / top, ignore=not_python)
    return tmp_path


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + textwrap.dedent(code))


def _new(check, tree: Path, plant) -> list[str]:
    """What ``check`` finds on the copy after ``plant`` that it did not find before."""
    before = set(check(tree))
    plant()
    return sorted(set(check(tree)) - before)


def test_an_upward_import_is_caught(tree):
    plant = lambda: _append(tree / "elsa_ds/admm/schedule.py", "def f():\n    from elsa_ds.jobs import report\n")  # noqa: E731
    (found,) = _new(rules.upward_imports, tree, plant)
    assert "elsa_ds.admm.schedule (layer 0) imports elsa_ds.jobs.report (layer 4)" in found
    assert "elsa_ds/admm/schedule.py:" in found


def test_an_import_of_a_room_listed_later_in_the_same_layer_is_caught(tree):
    plant = lambda: _append(tree / "elsa_ds/files/io.py", "def f():\n    from elsa_ds.settings import config\n")  # noqa: E731
    (found,) = _new(rules.upward_imports, tree, plant)
    assert "elsa_ds.files.io imports elsa_ds.settings.config, a room listed after its own in layer 1" in found
    assert "elsa_ds/files/io.py:" in found


def test_the_package_importing_launch_or_bench_is_caught(tree):
    (tree / "launch/__init__.py").touch()
    (found,) = _new(rules.upward_imports, tree, lambda: _append(tree / "elsa_ds/cli.py", "import launch.prune\n"))
    assert "elsa_ds.cli (layer 5) imports launch.prune (layer 6)" in found


def test_a_module_without_a_layer_is_caught(tree):
    (found,) = _new(rules.upward_imports, tree, lambda: (tree / "elsa_ds/newcomer.py").write_text("X = 1\n"))
    assert "elsa_ds.newcomer has no layer" in found and "add its name to LAYERS" in found


def test_a_cycle_through_a_function_level_import_is_caught(tree):
    def plant():
        _append(tree / "elsa_ds/errors.py", "def f():\n    from elsa_ds import version\n")
        _append(tree / "elsa_ds/version.py", "def g():\n    from elsa_ds.errors import ElsaError\n")

    (found,) = _new(_cycles, tree, plant)
    assert found.startswith("elsa_ds.errors (elsa_ds/errors.py:") and "-> elsa_ds.version (elsa_ds/version.py:" in found
    assert found.endswith("-> elsa_ds.errors")


def test_a_longer_cycle_is_caught_with_its_whole_path(tree):
    def plant():
        _append(tree / "elsa_ds/methods.py", "import elsa_ds.version\n")
        _append(tree / "elsa_ds/version.py", "def g():\n    import elsa_ds.errors\n")
        _append(tree / "elsa_ds/errors.py", "class C:\n    def m(self):\n        from . import methods\n")

    (found,) = _new(_cycles, tree, plant)
    assert found.count(" -> ") == 3 and all(m in found for m in ("elsa_ds.errors", "elsa_ds.methods", "elsa_ds.version"))


def test_a_switch_missing_from_the_switch_table_is_caught(tree):
    (found,) = _new(rules.unlisted_switches, tree, lambda: _append(tree / "elsa_ds/loss.py", 'PLANTED = "ELSA_DS_PLANTED"\n'))
    assert found.startswith("elsa_ds/loss.py:") and found.endswith(": ELSA_DS_PLANTED")


def test_a_long_line_is_caught(tree):
    plant = lambda: _append(tree / "elsa_ds/files/io.py", "# " + "x" * (rules.MAX_LINE_CHARS - 1) + "\n")  # noqa: E731
    (found,) = _new(rules.long_lines, tree, plant)
    assert found.startswith("elsa_ds/files/io.py:") and found.endswith(f": {rules.MAX_LINE_CHARS + 1} characters")
    assert not _new(rules.long_lines, tree, lambda: _append(tree / "bench/scale.py", "#" * rules.MAX_LINE_CHARS + "\n"))


def test_a_long_function_is_caught(tree):
    body = "".join(f"    x{i} = {i}\n" for i in range(rules.MAX_FUNCTION_LINES))  # def line + 60 = 61 lines
    (found,) = _new(rules.long_functions_and_files, tree, lambda: _append(tree / "elsa_ds/files/io.py", "def planted():\n" + body))
    assert found.endswith(f"planted: {rules.MAX_FUNCTION_LINES + 1} lines")


def test_private_torch_access_is_caught_outside_the_adapter_only(tree):
    code = """
        import deepspeed.runtime.zero.stage3 as s3
        from torch.utils.cpp_extension import _join_cuda_home
        import torch._dynamo


        def f():
            from torch import ops
            return ops.mkldnn._is_mkldnn_bf16_supported(), s3._private, torch.__version__
    """
    found = _new(rules.private_access_outside_compat, tree, lambda: _append(tree / "elsa_ds/zero/engine.py", code))
    names = sorted(line.split(": ")[1] for line in found)
    assert names == ["deepspeed.runtime.zero.stage3._private", "torch._dynamo", "torch.ops.mkldnn._is_mkldnn_bf16_supported",
                     "torch.utils.cpp_extension._join_cuda_home"]
    assert not _new(rules.private_access_outside_compat, tree, lambda: _append(tree / "elsa_ds/zero/compat.py", code))


def test_a_library_objects_private_member_is_caught_but_not_our_own_namedtuples_or_the_standard_librarys(tree):
    code = """
        import argparse


        class Local:
            def __init__(self):
                self._ours = 1


        def f(engine, point, local) -> argparse._ArgumentGroup:
            return engine._zero3_consolidated_16bit_state_dict(), point._replace(x=1), local._ours
    """
    (found,) = _new(rules.private_access_outside_compat, tree, lambda: _append(tree / "elsa_ds/zero/export.py", code))
    assert found.startswith("elsa_ds/zero/export.py:") and found.endswith(": engine._zero3_consolidated_16bit_state_dict")
