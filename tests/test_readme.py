"""The README stays a manual: at most 450 lines, prose lines of at most 120 characters (tables and fenced code may be
wider), a tests table that names every test file and folder (and nothing that is gone), and every repository path it
or docs/ mentions present in the checkout. Reference material goes to docs/ (design.md, results.md), not into wider
lines."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_README_LINES = 450
MAX_PROSE_CHARS = 120
# A token is taken for a repository path when it starts with one of these folders (out/, /tmp, ~/.cache are not).
REPO_FOLDERS = ("elsa_ds", "bench", "tests", "docs", "recipes", "ds_configs", "launch")
_SPAN = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def section(text: str, heading: str) -> str:
    """The body of the level-2 section ``heading`` (up to the next level-2 heading); '' when it is missing."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return match.group(1) if match else ""


def table_paths(text: str) -> list[list[str]]:
    """The paths in the first cell of each row of the README's tests table."""
    rows = [line for line in section(text, "Tests").splitlines() if line.startswith("|")]
    return [_SPAN.findall(row.split("|")[1]) for row in rows[2:]]  # rows[:2]: the header and its rule


def required_rows(root: Path) -> set[str]:
    """What the tests table must name: each top-level tests/test_*.py and each folder under tests/ holding tests."""
    tests = root / "tests"
    files = {f"tests/{p.name}" for p in tests.glob("test_*.py")}
    folders = {f"tests/{d.name}/" for d in tests.iterdir() if d.is_dir() and any(d.rglob("test_*.py"))}
    return files | folders


def table_problems(text: str, root: Path) -> list[str]:
    """Why the tests table is not current: rows without a path, paths that do not exist, test files without a row."""
    rows = table_paths(text)
    if not rows:
        return ["the README has no '## Tests' section with a table"]
    problems = [f"a tests-table row names no path (row {i + 1})" for i, paths in enumerate(rows) if not paths]
    named = {path for paths in rows for path in paths}
    problems += [f"the tests table names {path}, which does not exist" for path in sorted(named)
                 if not (root / path).exists() or (path.endswith("/") and not (root / path).is_dir())]
    problems += [f"{path} has no row in the README's tests table" for path in sorted(required_rows(root) - named)]
    return problems


def _expand(token: str) -> list[str]:
    """Brace alternatives as a shell expands them: a.{md,json} -> a.md, a.json (several groups multiply)."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", token)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(pattern: str, base: Path) -> bool:
    if any(ch in pattern for ch in "*?["):
        return any(base.glob(pattern))
    return (base / pattern).is_dir() if pattern.endswith("/") else (base / pattern).exists()


def path_problems(text: str, doc_dir: Path, root: Path) -> list[str]:
    """Repository paths named in code spans, code blocks or relative links that do not exist."""
    fences = _FENCE.findall(text)
    prose = _FENCE.sub("", text)
    tokens = [t for span in _SPAN.findall(prose) for t in span.split()] + [t for block in fences for t in block.split()]
    problems = []
    for token in tokens:
        token = token.strip("\"'(),.;:")
        if not token.startswith(tuple(f"{folder}/" for folder in REPO_FOLDERS)) or any(c in token for c in "<>$"):
            continue
        problems += [f"{name} does not exist" for name in _expand(token) if not _exists(name, root)]
    for target in _LINK.findall(prose):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:") and not _exists(target, doc_dir):
            problems.append(f"link target {target} does not exist")
    return sorted(set(problems))


def long_prose_lines(text: str) -> list[str]:
    """Lines over MAX_PROSE_CHARS outside tables (lines starting with '|') and fenced code blocks."""
    problems, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.startswith("|") and len(line) > MAX_PROSE_CHARS:
            problems.append(f"line {number}: {len(line)} characters (at most {MAX_PROSE_CHARS} outside tables and code)")
    return problems


def test_readme_is_manual_sized():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): measurements go to docs/results.md"


def test_readme_prose_lines_are_at_most_120_characters():
    assert long_prose_lines((ROOT / "README.md").read_text()) == []


def test_readme_tests_table_is_current():
    assert table_problems((ROOT / "README.md").read_text(), ROOT) == []


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md", "docs/design.md"])
def test_repository_paths_named_in_the_docs_exist(doc):
    path = ROOT / doc
    assert path_problems(path.read_text(), path.parent, ROOT) == []


def _fake_repo(tmp_path: Path, rows: str) -> tuple[Path, str]:
    for name in ("tests/test_a.py", "tests/test_b.py", "tests/sub/test_c.py", "tests/fixtures/data.txt", "bench/x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    readme = f"# t\n\n## Tests\n\n| file | what |\n|---|---|\n{rows}\n## Layout\n"
    return tmp_path, readme


def test_the_checks_catch_planted_violations(tmp_path):
    root, good = _fake_repo(tmp_path, "| `tests/test_a.py`, `tests/test_b.py` | a, b |\n| `tests/sub/` | c |\n")
    assert table_problems(good, root) == []  # fixtures/ holds no test file, so it needs no row
    _, missing_row = _fake_repo(tmp_path, "| `tests/test_a.py` | a |\n| `tests/sub/` | c |\n")
    assert table_problems(missing_row, root) == ["tests/test_b.py has no row in the README's tests table"]
    _, gone = _fake_repo(tmp_path, "| `tests/test_a.py`, `tests/test_b.py`, `tests/test_gone.py` | |\n| `tests/sub/` | c |\n")
    assert table_problems(gone, root) == ["the tests table names tests/test_gone.py, which does not exist"]
    assert table_problems("# no table\n", root) == ["the README has no '## Tests' section with a table"]
    text = ("Run `bench/x.py --json` and `bench/missing.py`; see `bench/{x,y}.py`, `out/demo` and [it](bench/x.py), "
            "[gone](docs/gone.md), [web](https://example.org).\n```bash\npython launch/nothing.py\n```\n")
    assert path_problems(text, root, root) == ["bench/missing.py does not exist", "bench/y.py does not exist",
                                               "launch/nothing.py does not exist", "link target docs/gone.md does not exist"]
    assert len((good + "line\n" * MAX_README_LINES).splitlines()) > MAX_README_LINES
    wide = "x" * (MAX_PROSE_CHARS + 1)
    assert long_prose_lines(f"ok\n| {wide} |\n```\n{wide}\n```\n{wide}\n") == [
        f"line 6: {MAX_PROSE_CHARS + 1} characters (at most {MAX_PROSE_CHARS} outside tables and code)"]
