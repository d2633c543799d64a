"""Wrong argument types to the Python API (``elsa_ds.prune`` / ``elsa_ds.oneshot``): an ElsaError naming the argument,
raised before anything is loaded or written -- never an AttributeError or TypeError from inside."""
from __future__ import annotations

import json
import os

import pytest
import torch

import elsa_ds
import elsa_ds.api
from elsa_ds.errors import ElsaError


def _meta_model(model_dir: str) -> torch.nn.Module:
    """The tiny model built on the meta device: shapes, no weights (``from_config`` under ``torch.device("meta")``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """A job started is a refusal missed (method=None ran 4096 ELSA steps): the job itself fails the test at once."""
    def started(*args, **kwargs):
        raise AssertionError("the job started: the call was not refused before work")

    monkeypatch.setattr(elsa_ds.api, "run_owned", started)


CASES = {  # name: (call, the argument the message must name first)
    "prune model int": (lambda m, d, o: elsa_ds.prune(123, d, output_dir=o), "model:"),
    "oneshot model int": (lambda m, d, o: elsa_ds.oneshot(7, "magnitude", d, output_dir=o), "model:"),
    "model list": (lambda m, d, o: elsa_ds.prune([m], d, output_dir=o), "model:"),
    "module without config": (lambda m, d, o: elsa_ds.oneshot(torch.nn.Linear(2, 2), "magnitude", d, output_dir=o), "model:"),
    "method int": (lambda m, d, o: elsa_ds.oneshot(m, 7, d, output_dir=o), "method=7"),
    "dataset int": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", 5, output_dir=o), "dataset"),
    "dataset dict": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", {"text": ["a b c"]}, output_dir=o), "dataset:"),
    "dataset of ints": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", [1, 2], output_dir=o), "dataset"),
    "output_dir int": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=3), "output_dir:"),
    "output_dir None": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=None), "output_dir:"),
    "deepspeed dict": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, deepspeed={"zero": 3}), "deepspeed:"),
    "tokenizer function": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, tokenizer=lambda t: t), "tokenizer:"),
    "overwrite str": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, overwrite="no"),
                      "overwrite='no': must be true or false"),
    "resume int": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, resume=7), "resume=7: must be true or false"),
    "recipe int": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, recipe=5), "recipe:"),
    "sparsity str": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, sparsity="lots"), "sparsity="),
    "seqlen list": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, seqlen=[64]), "seqlen="),
    "eval_ppl int": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, eval_ppl=5), "eval_ppl="),
    "init_mask int": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, init_mask=5), "init_mask="),
    "prune with wanda": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, method="wanda"), "elsa_ds.oneshot(model, 'wanda'"),
    "oneshot with elsa": (lambda m, d, o: elsa_ds.oneshot(m, "elsa", d, output_dir=o), "ELSA is elsa_ds.prune"),
    # None is an unset setting to ElsaConfig, which is ELSA: it ran elsa_ds.oneshot as 4096 ELSA steps
    "oneshot method None": (lambda m, d, o: elsa_ds.oneshot(m, None, d, output_dir=o), "method=None: elsa_ds.oneshot runs "
                            "a one-shot method (magnitude, wanda, sparsegpt)"),
    # a model without weights ended in torch's "Cannot copy out of meta tensor; no data!"
    "prune meta model": (lambda m, d, o: elsa_ds.prune(_meta_model(m), d, output_dir=o), "model: its weights are not loaded"),
    "oneshot meta model": (lambda m, d, o: elsa_ds.oneshot(_meta_model(m), "magnitude", d, output_dir=o),
                           "model: its weights are not loaded"),
    "export_format zip": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, export_format="zip"), "export_format"),
    "log_level loud": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, log_level="loud"), "log_level"),
    # pydantic read a boolean as the number 1 or 0 and "yes" or 1 as a boolean (steps=True: one step; seed=False: seed 0)
    "sparsity True": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, sparsity=True),
                      "sparsity=True: a boolean, where a number is taken"),
    "steps True": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, steps=True), "steps=True: a boolean"),
    "seed False": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, seed=False), "seed=False: a boolean"),
    "ignore_memory_check yes": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, ignore_memory_check="yes"),
                                "ignore_memory_check='yes': must be true or false"),
    "freeze_embeddings 1": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, freeze_embeddings=1),
                            "freeze_embeddings=1: must be true or false"),
    # right types, no meaning: ELSA's own settings given to a one-shot method
    "lmda to wanda": (lambda m, d, o: elsa_ds.oneshot(m, "wanda", d, output_dir=o, lmda=0.1, interval=8), "interval, lmda"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_wrong_argument_type_is_an_elsa_error_naming_it(name, tmp_path, tiny_model_dir, text_dir):
    call, names = CASES[name]
    out = tmp_path / "out"
    with pytest.raises(ElsaError) as err:
        call(str(tiny_model_dir), str(text_dir), str(out))
    assert names in str(err.value), str(err.value)
    assert "command line" not in str(err.value)  # a Python call has none: its arguments are named as such
    assert not out.exists() and list(tmp_path.iterdir()) == []      # nothing written, not even a lock or staging folder


def test_every_flag_of_a_job_is_a_keyword_of_the_api():
    """A flag the command line takes and the API refused as "unknown setting" (export_format, a user's walk): each of
    JobOptions' flags is an argument of prune / oneshot or one of the keywords they pass on to it."""
    from elsa_ds.api import RUN_SETTINGS
    from elsa_ds.settings.flags import cli_fields
    from elsa_ds.settings.options import JobOptions

    arguments = {"deepspeed", "output_dir", "overwrite", "resume", "recipe"}
    assert set(cli_fields(JobOptions)) == arguments | set(RUN_SETTINGS)


class _Where:
    """An os.PathLike that is not a pathlib.Path (as a framework's own path type is)."""

    def __init__(self, path):
        self.path = str(path)

    def __fspath__(self):
        return self.path


def test_every_path_setting_takes_a_path_like(monkeypatch, tmp_path, tiny_model_dir, text_dir):
    """model, dataset, output_dir and deepspeed took a Path and the other path settings refused one ("Input should be a
    valid string"): each takes any os.PathLike and reaches the job as the path's text."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"mlp": 0.6}))
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"source": "this test", "settings": {"seed": 3}}))
    paths = {"sparsity_profile": profile, "val_dataset": _Where(text_dir), "init_mask": tiny_model_dir, "nvme_path": tmp_path,
             "eval_include_path": _Where(tmp_path)}
    seen = {}
    monkeypatch.setattr(elsa_ds.api, "run_owned", lambda cfg, opts, ds_config: seen.update(cfg=cfg, opts=opts))
    elsa_ds.prune(tiny_model_dir, _Where(text_dir), output_dir=_Where(tmp_path / "out"), recipe=recipe, steps=64,
                  eval_ppl=[_Where(text_dir), "c4"], **paths)
    cfg = seen["cfg"]
    assert {k: getattr(cfg, k) for k in paths} == {k: os.fspath(v) for k, v in paths.items()}
    assert (cfg.model, cfg.dataset, cfg.eval_ppl) == (str(tiny_model_dir), str(text_dir), [str(text_dir), "c4"])
    assert cfg.seed == 3 and seen["opts"].output_dir == tmp_path / "out"


def _settings_models() -> dict[str, tuple[type, dict]]:
    """Every settings model a command or the API validates, with what it requires."""
    from elsa_ds.cli import EstimateOptions
    from elsa_ds.jobs.evaluate import EvalSettings
    from elsa_ds.settings.config import ElsaConfig
    from elsa_ds.settings.options import JobOptions
    from elsa_ds.sparse.cli import CompressSettings

    return {"ElsaConfig": (ElsaConfig, {}), "JobOptions": (JobOptions, {"deepspeed": "zero3", "output_dir": "o"}),
            "EvalSettings": (EvalSettings, {"model": "m"}), "EstimateOptions": (EstimateOptions, {}),
            "CompressSettings": (CompressSettings, {"input": "i"})}


@pytest.mark.parametrize("name", ["ElsaConfig", "JobOptions", "EvalSettings", "EstimateOptions", "CompressSettings"])
def test_every_settings_model_takes_a_boolean_where_a_field_is_one_and_only_there(name):
    """pydantic read "yes", 1 or 0.0 as a boolean, a boolean as the number 1 or 0 and "5" as 5 (``steps=True`` ran one step,
    ``--limit`` from a Python caller's True one window); numpy's boolean is a boolean. Every field, a later one too."""
    import typing

    import numpy as np
    from pydantic import ValidationError

    model, required = _settings_models()[name]

    def problem(field: str, value) -> str | None:
        try:
            model.model_validate({**required, field: value})
        except ValidationError as err:
            return next((e["msg"] for e in err.errors() if e["loc"][:1] == (field,)), None)
        return None

    checked = 0
    for field, info in model.model_fields.items():
        leaves = {info.annotation, *typing.get_args(info.annotation)}
        if bool in leaves:
            assert "must be true or false" in (problem(field, "yes") or ""), field
            assert "must be true or false" in (problem(field, 1) or ""), field
            assert problem(field, np.bool_(True)) is None and problem(field, False) is None, field
            checked += 1
        elif {int, float} & leaves:
            for value in (True, np.bool_(False)):
                assert "a boolean, where a number is taken" in (problem(field, value) or ""), (field, value)
            assert "text, where a number is taken" in (problem(field, "5") or ""), field  # "5" was read as 5
            checked += 1
    assert checked >= 2, "no boolean or number field was checked"
    if name == "ElsaConfig":  # a pair's items too: betas=(0.9, False) was (0.9, 0.0)
        assert "a boolean" in (problem("betas", (0.9, False)) or "")


def test_a_datasets_text_that_is_not_text_is_refused_and_a_none_is_no_document():
    """An audit: ``str()`` made a None text "None" (and a number its digits), which the job then trained on."""
    from datasets import Dataset

    assert elsa_ds.api._texts(Dataset.from_dict({"text": ["a b", None, "c"]})) == ["a b", "c"]
    with pytest.raises(ElsaError, match=r"the dataset's 'text' column holds int values \(0\), not strings"):
        elsa_ds.api._texts(Dataset.from_dict({"text": [0, 1]}))


def test_documents_given_in_memory_on_a_full_tmpdir_are_an_elsa_error_and_leave_nothing(tmp_path, tiny_model_dir, monkeypatch):
    """An audit (OS limits, 2026-12-07): a full TMPDIR was a raw OSError (No space left on device) from the API, which
    promises an ElsaError. A real full disk: a 64 KiB tmpfs, where this process may mount one (root, as CI is)."""
    import tempfile

    from tests.conftest import tmpfs

    with tmpfs(tmp_path / "small", "size=64k") as small:
        monkeypatch.setattr(tempfile, "tempdir", str(small))
        with pytest.raises(ElsaError, match=r"dataset: the documents given in memory could not be written to .*No space left "
                                            r"on device.*set TMPDIR to a folder with room"):
            elsa_ds.prune(str(tiny_model_dir), ["word " * 50_000] * 4, output_dir=str(tmp_path / "out"))
        assert list(small.iterdir()) == [] and not (tmp_path / "out").exists()
