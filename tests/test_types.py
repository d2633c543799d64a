"""The type check ([tool.mypy] in pyproject.toml) is strict enough to catch what it is there for: a call with an argument
of the wrong type and an Optional used without a check. Planted in a tiny file that imports elsa_ds, checked with the
project's own configuration; the same file with the two lines corrected passes, so the errors are the planted ones."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

PLANTED = '''\
from pathlib import Path

from elsa_ds.files.weight_files import safetensors_problem, stored_shapes

stored_shapes({folder})
problem = safetensors_problem(Path("model.safetensors"))
print(problem{use})
'''
WRONG = {"folder": "42", "use": ".upper()"}                  # an int for a folder; str | None used as a str
RIGHT = {"folder": '"out/model"', "use": " and problem.upper()"}


def _mypy(tmp_path: Path, lines: dict[str, str]) -> subprocess.CompletedProcess:
    """mypy with the project's configuration on the planted file only (elsa_ds is read, its own errors not shown)."""
    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED.format(**lines))
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--follow-imports=silent",
           "--cache-dir", str(tmp_path / "cache"), str(planted)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_type_check_catches_a_wrong_argument_type_and_an_unchecked_optional(tmp_path):
    proc = _mypy(tmp_path, WRONG)
    errors = [line for line in proc.stdout.splitlines() if ": error: " in line]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(errors) == 2, proc.stdout
    assert 'planted.py:5: error: Argument 1 to "stored_shapes" has incompatible type "int"' in errors[0], errors
    assert errors[0].endswith("[arg-type]"), errors
    assert 'planted.py:7: error: Item "None" of "str | None" has no attribute "upper"' in errors[1], errors
    assert errors[1].endswith("[union-attr]"), errors


def test_the_planted_file_corrected_passes(tmp_path):
    proc = _mypy(tmp_path, RIGHT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
