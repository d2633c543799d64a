"""Texts and task data from the hub: refused before any work where the hub cannot be asked and the caches hold none of
them (a walk: --eval_tasks boolq failed offline after the whole job, in a traceback; --eval_ppl wikitext2 too)."""
from __future__ import annotations

from pathlib import Path

import pytest

from elsa_ds.data import hub_texts
from elsa_ds.errors import ElsaError
from elsa_ds.settings.config import DEMO_MODEL_DIR, NAMED_TEXT_SOURCES
from tests.conftest import run_entry


@pytest.fixture
def caches(tmp_path, monkeypatch):
    import datasets.config
    from huggingface_hub import constants

    hub, local = tmp_path / "hub", tmp_path / "datasets"
    hub.mkdir(), local.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(local))
    return hub, local


def test_what_needs_the_hub_and_what_a_cache_holds(tmp_path, caches):
    hub, local = caches
    assert hub_texts.hub_repo("shakespeare") is None and hub_texts.hub_repo(str(tmp_path)) is None
    assert hub_texts.hub_repo("c4") == "allenai/c4" and hub_texts.hub_repo("wikitext2") == "wikitext"
    assert hub_texts.hub_repo("someone/texts") == "someone/texts"
    assert not hub_texts.cached("wikitext") and not hub_texts.cached("allenai/c4")
    (hub / "datasets--Salesforce--wikitext").mkdir()  # moved to a namespace on the hub: still found
    (local / "allenai___c4").mkdir()
    assert hub_texts.cached("wikitext") and hub_texts.cached("allenai/c4") and not hub_texts.cached("aps/super_glue")


def test_offline_and_uncached_is_refused_naming_each_and_reachable_or_cached_is_not(caches, monkeypatch):
    shapes = hub_texts

    needed = {"--dataset 'shakespere'": "shakespere", "--eval_ppl 'wikitext2'": "wikitext"}
    monkeypatch.setattr(shapes, "hub_unreachable", lambda: "HF_HUB_OFFLINE is set")
    with pytest.raises(ElsaError) as err:
        hub_texts.check_hub_texts(needed, {}, NAMED_TEXT_SOURCES)
    said = str(err.value)
    assert said.startswith("--dataset 'shakespere' (shakespere; did you mean shakespeare?); --eval_ppl 'wikitext2' (wikitext):")
    assert "HF_HUB_OFFLINE is set" in said and "give a local file or folder" in said and "\n" not in said
    with pytest.raises(ElsaError, match=r"^--tasks boolq \(aps/super_glue\): a dataset .* use task YAMLs that read local "
                                        r"files \(--include_path FOLDER"):  # the flag that reads them, named (an audit)
        hub_texts.check_hub_texts({}, {"--tasks boolq": "aps/super_glue"})
    with pytest.raises(ElsaError, match=r"\(--eval_include_path FOLDER"):
        hub_texts.check_hub_texts({}, {"--eval_tasks boolq": "aps/super_glue"})
    with pytest.raises(ElsaError) as err:  # a mistyped relative folder reads as a hub id: the message says neither is here
        hub_texts.check_hub_texts({"--dataset 'data/plays'": "data/plays"}, {})
    assert str(err.value).startswith(f"--dataset 'data/plays' (data/plays; no file or folder of that name in {Path.cwd()} either):")
    hub, _ = caches
    (hub / "datasets--aps--super_glue").mkdir()
    hub_texts.check_hub_texts({}, {"--tasks boolq": "aps/super_glue"})  # cached: the loader may find it
    monkeypatch.setattr(shapes, "hub_unreachable", lambda: None)
    hub_texts.check_hub_texts(needed, {})  # the hub can be asked: the loader will


@pytest.mark.integration
def test_a_pruning_job_asked_for_task_data_it_cannot_fetch_is_refused_before_it_starts(tmp_path):
    proc = run_entry("prune.py", ["--deepspeed", "zero3_offload", "--method", "magnitude", "--output_dir", str(tmp_path / "o"),
                                  "--eval_tasks", "boolq", "--eval_ppl", "wikitext2"], check=False, timeout=300,
                     env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert "--eval_ppl 'wikitext2' (wikitext)" in errors[0] and "--eval_tasks boolq (aps/super_glue)" in errors[0]
    assert not (tmp_path / "o").exists() and "pruned" not in proc.stdout  # refused before any work
    proc = run_entry("evaluate.py", ["--model", str(DEMO_MODEL_DIR), "--tasks", "boolq", "--limit", "2"], check=False,
                     timeout=300, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--tasks boolq (aps/super_glue)" in proc.stderr


def test_a_missing_path_is_named_as_one_not_taken_for_a_hub_dataset(tmp_path):
    """A user's walk: ``elsa-evaluate --ppl w/nonexistent.txt`` was refused as a hub dataset that cannot be asked."""
    from elsa_ds.errors import ElsaError

    for flag, source in (("--ppl", "w/nonexistent.txt"), ("--dataset", "./mine"), ("--eval_ppl", "~/no/such.jsonl")):
        with pytest.raises(ElsaError, match=rf"^{flag} '{source}': no such file or directory$"):
            hub_texts.text_repos(iter([("--dataset", "c4"), (flag, source)]))
    (tmp_path / "here.txt").write_text("text")
    assert hub_texts.text_repos(iter([("--ppl", str(tmp_path / "here.txt")), ("--ppl", "c4")])) == {"--ppl 'c4'": "allenai/c4"}
