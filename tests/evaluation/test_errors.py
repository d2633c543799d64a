"""Bad input to launch/evaluate.py: exit code 2, one `elsa_ds: error` line naming the problem, no traceback."""
from __future__ import annotations

import pytest

from tests.conftest import run_entry, run_fails


def _fails(args: list[str], *needles: str) -> str:
    return run_fails("evaluate.py", args, *needles)


def test_a_refusal_before_the_model_loads_is_not_preceded_by_the_settings(tmp_path, tiny_model_dir, offline):
    """A wrong --ppl file or model folder: the one error line, not the 22 lines of settings first (a user's walk)."""
    for args in (["--model", str(tiny_model_dir), "--ppl", str(tmp_path / "tset.jsonl")],
                 ["--model", str(tmp_path), "--ppl", "wikitext2"]):
        proc = run_entry("evaluate.py", args, check=False, timeout=300)
        assert proc.returncode == 2 and "evaluation settings" not in proc.stdout + proc.stderr, proc.stdout[-2000:]


def test_missing_model_dir(tmp_path, offline):
    _fails(["--model", str(tmp_path / "no_such_model"), "--ppl", "wikitext2"], "no_such_model", "no such directory")


def test_unloadable_hub_id(offline):
    _fails(["--model", "elsa-ds-tests/no-such-model"], "elsa-ds-tests/no-such-model", "cannot load")


def test_empty_text_file(tmp_path, tiny_model_dir, offline):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(["--model", str(tiny_model_dir), "--ppl", str(empty), "--seqlen", "64"], "empty.txt", "no windows")


@pytest.mark.integration
def test_unknown_task_before_loading(tmp_path, offline):
    # the model does not exist: the task check must come first to report the task
    _fails(["--model", str(tmp_path / "no_such_model"), "--tasks", "boolq,no_such_task_xyz,hellaswagg"],
           "no_such_task_xyz", "hellaswagg", "did you mean hellaswag")


def test_compare_unreadable(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    _fails(["--compare", str(bad), str(tmp_path / "missing.json")], "bad.json", "not a readable JSON")


@pytest.mark.parametrize("args, needles", [
    (["--speed_rounds", "9", "--speed_prompt", "7"], ["--speed_prompt (read by --speed)", "--speed_rounds (read by --speed)"]),
    (["--ppl", "shakespeare", "--include_path", "."], ["--include_path (read by --tasks)"]),
    (["--seqlen", "128", "--batch_size", "4"], ["--seqlen (read by --ppl)", "--batch_size (read by --ppl and --tasks)"]),
    (["--ppl", "shakespeare", "--offload_folder", "."], ["--offload_folder (read by --device_map auto)"]),
])
def test_a_flag_for_an_evaluation_the_command_does_not_run_is_refused(tmp_path, capsys, args, needles):
    """An audit (2026-12-07): elsa-evaluate took --speed_rounds without --speed, --include_path without --tasks, --seqlen
    without --ppl and printed the sparsity table alone, as if they had been used. Refused before the model is read."""
    from elsa_ds.cli import main_evaluate

    assert main_evaluate(["--model", str(tmp_path / "never read"), *args]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("elsa_ds: error")]
    assert "does not run" in line and all(n in line for n in needles), line
