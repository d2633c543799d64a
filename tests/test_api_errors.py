"""Wrong argument types to the Python API (``elsa_ds.prune`` / ``elsa_ds.oneshot``): an ElsaError naming the argument,
raised before anything is loaded or written -- never an AttributeError or TypeError from inside."""
from __future__ import annotations

import pytest
import torch

import elsa_ds
from elsa_ds.errors import ElsaError

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
    "overwrite str": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, overwrite="no"), "overwrite:"),
    "resume int": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, resume=7), "resume:"),
    "recipe int": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, recipe=5), "recipe:"),
    "sparsity str": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, sparsity="lots"), "sparsity="),
    "seqlen list": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, seqlen=[64]), "seqlen="),
    "eval_ppl int": (lambda m, d, o: elsa_ds.oneshot(m, "magnitude", d, output_dir=o, eval_ppl=5), "eval_ppl="),
    "init_mask int": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, init_mask=5), "init_mask="),
    "prune with wanda": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, method="wanda"), "elsa_ds.oneshot(model, 'wanda'"),
    "oneshot with elsa": (lambda m, d, o: elsa_ds.oneshot(m, "elsa", d, output_dir=o), "ELSA is elsa_ds.prune"),
    "export_format zip": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, export_format="zip"), "export_format"),
    "log_level loud": (lambda m, d, o: elsa_ds.prune(m, d, output_dir=o, log_level="loud"), "log_level"),
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
