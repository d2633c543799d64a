"""elsa_ds.prune / elsa_ds.oneshot from Python: the same jobs as launch/prune.py, so the same masks."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, derived_config, play_text, run_entry

pytestmark = pytest.mark.integration

SETTINGS = {"seqlen": 64, "steps": 8, "interval": 4, "sparsity": 0.6, "lr": 1e-3, "lmda": 0.05, "val_windows": 0,
            "baseline": "none", "micro_batch": 2, "seed": 1}


def _documents() -> list[str]:
    """Paragraph-sized documents of two plays."""
    paragraphs = [p.strip() for name in ("macbeth", "othello") for p in play_text(name).split("\n\n") if p.strip()]
    return ["\n\n".join(paragraphs[i:i + 40]) for i in range(0, len(paragraphs), 40)]


def _masks(out) -> dict[str, torch.Tensor]:
    report = json.loads((out / "elsa_report.json").read_text())
    weights = load_file(out / "model.safetensors")
    return {k: weights[k] != 0 for k in report["layers"]}


def _python(script: str) -> str:
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_prune_from_python_on_a_list_of_strings_equals_the_cli(tmp_path, tiny_model_dir):
    docs = _documents()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    ds = derived_config(tmp_path, bf16={"enabled": False})
    flags = [x for k, v in SETTINGS.items() for x in (f"--{k}", str(v))]
    run_entry("prune.py", ["--deepspeed", str(ds), "--model", str(tiny_model_dir), "--dataset", str(tmp_path / "docs.jsonl"), *flags,
                           "--output_dir", str(tmp_path / "cli")])
    out = _python(f"""
import json, os, elsa_ds
from transformers import AutoModelForCausalLM, AutoTokenizer
docs = json.load(open({str(tmp_path / 'docs.json')!r}))
by_name = elsa_ds.prune({str(tiny_model_dir)!r}, docs, output_dir={str(tmp_path / 'api')!r}, deepspeed={str(ds)!r}, **{SETTINGS!r})
model = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r}, dtype="float32")
loaded = elsa_ds.prune(model, docs, tokenizer=AutoTokenizer.from_pretrained({str(tiny_model_dir)!r}),
                       output_dir={str(tmp_path / 'api_loaded')!r}, deepspeed={str(ds)!r}, **{SETTINGS!r})
leaked = [k for k in ("RANK", "WORLD_SIZE", "MASTER_PORT") if k in os.environ]
print(json.dumps({{"by_name": by_name["method"], "loaded": loaded["model"], "sparsity": loaded["overall_sparsity"], "leaked": leaked}}))
""")
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["by_name"] == "elsa" and summary["sparsity"] == pytest.approx(0.6, abs=1e-4)
    assert summary["leaked"] == []  # a later subprocess must not take itself for a launched rank
    cli = _masks(tmp_path / "cli")
    for run in ("api", "api_loaded"):
        masks = _masks(tmp_path / run)
        assert masks.keys() == cli.keys()
        assert all(torch.equal(masks[k], cli[k]) for k in cli), run


def test_oneshot_from_python_prunes_a_loaded_model_in_place(tmp_path, tiny_model_dir):
    out = _python(f"""
import json, logging, os, warnings, elsa_ds
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r}, dtype="float32")
logging.getLogger("transformers").setLevel(logging.DEBUG)  # the caller's own logging, which log_level= must leave as it was
from elsa_ds.log import get_logger; get_logger("elsa_ds")  # the console any elsa_ds call installs (info) until log_level= is given
before = (logging.getLogger("elsa_ds").level, len(logging.getLogger("elsa_ds").handlers), len(warnings.filters))
report = elsa_ds.oneshot(model, "magnitude", "shakespeare", tokenizer=AutoTokenizer.from_pretrained({str(tiny_model_dir)!r}),
                         output_dir={str(tmp_path / 'mag')!r}, deepspeed="zero3", sparsity=0.5, seqlen=64, val_windows=2,
                         export_format="sparse", ignore_memory_check=True, log_level="warning")  # the job's own flags too
w = model.model.layers[0].mlp.up_proj.weight
after = (logging.getLogger("elsa_ds").level, len(logging.getLogger("elsa_ds").handlers), len(warnings.filters))
print(json.dumps({{"zeros": int((w == 0).sum()), "numel": w.numel(), "method": report["method"], "dense": report["ppl"]["dense"],
                  "format": report["export"]["format"], "logging_kept": before == after,
                  "transformers_level": logging.getLogger("transformers").level}}))
""")
    got = json.loads(out.strip().splitlines()[-1])
    assert got["method"] == "magnitude" and got["dense"] > 1 and got["format"] == "sparse"
    assert got["logging_kept"] and got["transformers_level"] == logging.DEBUG  # log_level= held for the call only
    assert "elsa_sparse" in json.loads((tmp_path / "mag" / "config.json").read_text())
    assert got["zeros"] == round(0.5 * got["numel"])


def test_documents_given_in_memory_are_named_by_their_content_and_resume_with_the_same_documents(tmp_path, tiny_model_dir):
    """An audit (2026-12-07): the report named the temporary file the documents were read from (gone once the call
    returned), and a resume with the very same documents was refused for that file's new path."""
    docs = _documents()
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    ds = derived_config(tmp_path, bf16={"enabled": False})
    out = _python(f"""
import json, elsa_ds
from elsa_ds.errors import ElsaError
docs = json.load(open({str(tmp_path / 'docs.json')!r}))
kw = dict(output_dir={str(tmp_path / 'out')!r}, deepspeed={str(ds)!r}, **{{**{SETTINGS!r}, "steps": 4, "interval": 2}}, save_interval=2)
first = elsa_ds.prune({str(tiny_model_dir)!r}, docs, **kw)
again = elsa_ds.prune({str(tiny_model_dir)!r}, docs, resume=True, **kw)
done = elsa_ds.prune({str(tiny_model_dir)!r}, docs, resume_if_any=True, **kw)  # finished: nothing to do, the same run
assert done["config"]["dataset"] == again["dataset"] and done["wall_s"] == again["wall_s"], (done["config"]["dataset"], again)
try:
    elsa_ds.prune({str(tiny_model_dir)!r}, docs[1:], resume=True, **kw)
    other = None
except ElsaError as err:
    other = str(err)
print(json.dumps({{"first": first["dataset"], "again": again["dataset"], "resumed_at": again["resumed_at_step"], "other": other}}))
""")
    got = json.loads(out.strip().splitlines()[-1])
    assert got["first"].startswith(f"in-memory documents ({len(docs)}, sha256 ") and got["again"] == got["first"]
    assert got["resumed_at"] == 2
    assert got["other"] and "--resume with changed settings" in got["other"] and f"({len(docs) - 1}, sha256" in got["other"]


def test_jobs_in_one_process_release_their_engines_keep_the_callers_generator_and_run_one_at_a_time(tmp_path, tiny_model_dir):
    """An audit (the API in a long-lived process): each prune's DeepSpeed engine stayed alive for the rest of the
    process (~43 bytes per parameter a call: a sweep runs out of memory), each call reseeded the caller's torch
    generator (a sweep drew the same "random" settings after every call), and two jobs in two threads corrupted each
    other and the next call. Now: no engine left after a call, the caller's draws as if no call had happened, and a
    second job while one runs refused in one line."""
    docs = _documents()
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    ds = derived_config(tmp_path, bf16={"enabled": False})
    out = _python(f"""
import gc, json, torch, elsa_ds
from deepspeed.runtime.engine import DeepSpeedEngine
from elsa_ds.errors import ElsaError
docs = json.load(open({str(tmp_path / 'docs.json')!r}))
kw = dict(deepspeed={str(ds)!r}, **{{**{SETTINGS!r}, "steps": 2, "interval": 2}})
torch.manual_seed(1234)
expected = torch.rand(3).tolist()
torch.manual_seed(1234)
draws, engines = [torch.rand(1).item()], []
for i in (1, 2):
    elsa_ds.prune({str(tiny_model_dir)!r}, docs, output_dir={str(tmp_path)!r} + f"/out{{i}}", **kw)
    draws.append(torch.rand(1).item())
    gc.collect()
    engines.append(sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects()))
elsa_ds.api._ONE_JOB.acquire()  # as a job in another thread holds it
try:
    elsa_ds.prune({str(tiny_model_dir)!r}, docs, output_dir={str(tmp_path / 'out3')!r}, **kw)
    refused = None
except ElsaError as err:
    refused = str(err)
print(json.dumps({{"expected": expected, "draws": draws, "engines": engines, "refused": refused}}))
""")
    got = json.loads(out.strip().splitlines()[-1])
    assert got["draws"] == got["expected"], got
    assert got["engines"] == [0, 0], got
    assert got["refused"] == ("another elsa_ds job runs in this process (another thread): run jobs one after another, or in "
                              "separate processes")
    assert not (tmp_path / "out3").exists()
