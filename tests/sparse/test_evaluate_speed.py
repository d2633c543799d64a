"""launch/evaluate.py --speed on the magnitude-pruned demo: a dense pruned folder (compressed on the fly) and a sparse
checkpoint give the same structure (bytes, memory, prefill and decode at batch 1 and 8 with their floors, generate()
end to end with the same greedy tokens) and logits that agree; bad input is one line and exit 2 with nothing written. Timings are not asserted: only their structure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from elsa_ds.cli import main_evaluate

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--speed", "--speed_prompt", "8", "--speed_steps", "2", "--speed_rounds", "2"]


def _check_report(r: dict, model: Path, compressed_here: bool) -> None:
    assert r["model"] == str(model) and r["compressed_here"] is compressed_here and r["pruned_weights"] == 4 * 7
    disk = r["disk"]
    assert disk["pruned_sparse"] < 0.5 * disk["pruned_dense"] and disk["model_sparse"] < disk["model_dense"]
    assert r["memory"]["sparse"]["tensor_bytes"] < r["memory"]["dense"]["tensor_bytes"]
    assert r["logits_max_rel_err"] <= 1e-3
    bandwidth = r["read_bandwidth_gb_s"] * 1e9
    for phase, tokens in (("prefill", 8), ("decode", 1)):
        assert [row["batch"] for row in r[phase]] == [1, 8]
        for row in r[phase]:
            assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
            assert row["sparse"]["bytes_per_step"] < row["dense"]["bytes_per_step"]
            for mode in ("dense", "sparse"):
                floor = row["batch"] * tokens * bandwidth / row[mode]["bytes_per_step"]
                assert row[mode]["tokens_per_s"] > 0 and abs(row[mode]["floor_tokens_per_s"] / floor - 1) < 1e-9
    assert r["device"] == "cpu" and "rss_delta_bytes" in r["memory"]["dense"]
    assert [row["batch"] for row in r["generate"]] == [1, 8]
    for row in r["generate"]:  # generate() as a user calls it: greedy tokens of the sparse mode are the dense mode's
        assert row["same_tokens"] is True and row["steps"] == 2 and row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert row["dense"]["tokens_per_s"] > 0 and row["sparse"]["tokens_per_s"] > 0 and row["equal_token_fraction"] == 1.0
        assert row["dense"]["first_call_s"] > 0 and row["sparse"]["first_call_s"] > 0  # the untimed call (on CUDA: the compile)


def test_speed_of_a_dense_pruned_folder_through_the_script(pruned_dir, tmp_path):
    out = tmp_path / "speed.json"
    done = subprocess.run([sys.executable, str(ROOT / "launch" / "evaluate.py"), "--model", str(pruned_dir), *FAST, "--output", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "| decode (2 steps) | 8 |" in done.stdout and "| stored tensor bytes, pruned weights |" in done.stdout
    assert "| 2 new tokens after 8 | 8 |" in done.stdout
    report = json.loads(out.read_text())
    _check_report(report, pruned_dir, compressed_here=True)
    files = report["disk"]["sparse_files"]  # the files' own sizes, headers and checksums included (an audit)
    assert f"| weight files on disk (headers included) | n/a | {files / 1e6:.1f} MB | n/a |" in done.stdout, done.stdout
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("elsa_speed_*/sparse/config.json"))  # temp removed


def test_speed_of_a_sparse_checkpoint(sparse_dir, tmp_path, capsys):
    out, md = tmp_path / "speed.json", tmp_path / "speed.md"
    assert main_evaluate(["--model", str(sparse_dir), *FAST, "--output", str(out), "--markdown", str(md)]) == 0
    r = json.loads(out.read_text())
    _check_report(r, sparse_dir, compressed_here=False)
    assert r["settings"]["speed_prompt"] == 8 and md.read_text() in capsys.readouterr().out


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "speed.json"
    demo = ROOT / "elsa_ds" / "demo" / "model"  # not pruned: nothing to compress
    cases = [(["--model", str(demo)], "no 2-D weight"), (["--model", str(tmp_path / "absent")], "needs a local model folder"),
             (["--model", str(demo), "--ppl", "c4"], "run --ppl/--tasks in a separate command"),
             (["--model", str(demo), "--dtype", "fp32"], "--dtype is for --ppl/--tasks: drop it"),
             (["--model", str(demo), "--limit", "4", "--seqlen", "64"], "--limit, --seqlen are for --ppl/--tasks")]
    for args, expected in cases:
        assert main_evaluate([*args, *FAST, "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert expected in err[-1] and not any("Traceback" in line for line in err)
    assert not out.exists()
