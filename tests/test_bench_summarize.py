"""bench/models/summarize.py: built and unbuilt models, a quality.json of the current format, bad input refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.models.build import RECIPES
from bench.models.summarize import KEEP, main

ROOT = Path(__file__).resolve().parents[1]
QUALITY = ROOT / "bench" / "results" / "quality_check-qwen2.json"  # a real bench/quality.py output


def fake_build(models: Path, name: str) -> dict:
    metrics = {k: f"{k}-value" for k in KEEP} | {"corpus": {"name": RECIPES[name][0]}, "settings": {"steps": 1}}
    (models / name).mkdir(parents=True)
    (models / name / "training_metrics.json").write_text(json.dumps(metrics))
    return metrics


def test_built_model_with_quality_rows_and_unbuilt_model(tmp_path):
    built, unbuilt = list(RECIPES)[:2]
    metrics = fake_build(tmp_path / "models", built)
    out = tmp_path / "models.json"
    assert main(["--models", str(tmp_path / "models"), "--quality", f"{built}={QUALITY}", "--quality", f"{built}={QUALITY}",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data[unbuilt]["built"] is False and data[unbuilt]["build"].endswith(f"--name {unbuilt}")
    entry = data[built]
    assert entry["built"] is True and all(entry[k] == metrics[k] for k in KEEP)
    q = json.loads(QUALITY.read_text())
    assert len(entry["quality"]) == 2 and entry["quality"][0] == entry["quality"][1]
    got = entry["quality"][0]
    assert [(r["row"], r["sparsity"]) for r in got["results"]] == [(r["row"], r["sparsity"]) for r in q["results"]]
    assert [r["ppl"] for r in got["results"]] == [round(r["ppl"], 3) for r in q["results"]]
    assert got["eval"] == Path(q["eval"]).name and got["steps"] == q["steps"] and got["file"] == QUALITY.name
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("bad,says", [("nosuchmodel={q}", "expected NAME=FILE"), ("{name}={missing}", "is not a file"),
                                      ("{name}={old}", "not a bench/quality.py JSON")])
def test_bad_quality_argument_exits_2_and_keeps_the_old_json(tmp_path, bad, says, capsys):
    name = list(RECIPES)[0]
    fake_build(tmp_path / "models", name)
    old = tmp_path / "old_format.json"
    old.write_text(json.dumps({"dense_ppl": 1.0, "results": [{"method": "wanda", "ppl": 2.0}]}))  # the earlier format
    out = tmp_path / "models.json"
    out.write_text("previous\n")
    arg = bad.format(q=QUALITY, name=name, missing=tmp_path / "missing.json", old=old)
    with pytest.raises(SystemExit) as e:
        main(["--models", str(tmp_path / "models"), "--quality", arg, "--json", str(out)])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert out.read_text() == "previous\n"
