"""Bad input stops early with one clear line on stderr, exit code 2, no traceback, nothing overwritten."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import derived_config, run_fails


def _fails(args: list[str], *needles: str) -> str:
    return run_fails("prune.py", args, *needles)


def test_sparsity_out_of_range(tmp_path):
    for bad in ("1.0", "-0.1"):
        _fails(["--deepspeed", "ds_configs/zero3.json", "--sparsity", bad, "--output_dir", str(tmp_path / "o")], "sparsity")


def test_unreadable_and_malformed_config(tmp_path):
    _fails(["--deepspeed", str(tmp_path / "missing.json"), "--output_dir", str(tmp_path / "o")], "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,,}')
    _fails(["--deepspeed", str(bad), "--output_dir", str(tmp_path / "o")], "not valid JSON", "line 1")


def test_a_key_named_twice_in_a_config_a_recipe_or_a_profile_is_refused(tmp_path):
    """JSON leaves a repeated key's value to the reader: Python kept the last ``stage`` (1 beside 3 in one object: the
    job ran at whichever came last), DeepSpeed's own reader refuses such a file. The three files a user writes for a
    job say which key they repeat; a model's config.json is read as transformers reads it."""
    import json

    from elsa_ds.models import config_json

    ds = json.loads(open("ds_configs/zero3.json").read())
    text = json.dumps(ds).replace('"stage": 3', '"stage": 1, "stage": 3')
    assert text.count('"stage"') == 2
    (dup_ds := tmp_path / "ds.json").write_text(text)
    _fails(["--deepspeed", str(dup_ds), "--output_dir", str(tmp_path / "o")], "ds.json", '"stage" appears twice')
    (recipe := tmp_path / "r.json").write_text('{"sparsity": 0.5, "sparsity": 0.9}')
    _fails(["--deepspeed", "ds_configs/zero3.json", "--recipe", str(recipe), "--output_dir", str(tmp_path / "o")],
           "r.json", '"sparsity" appears twice')
    (profile := tmp_path / "p.json").write_text('{"layers\\\\.0\\\\.": 0.5, "layers\\\\.0\\\\.": 0.9}')
    _fails(["--deepspeed", "ds_configs/zero3.json", "--sparsity_profile", str(profile), "--output_dir", str(tmp_path / "o")],
           "p.json", "appears twice")
    (model := tmp_path / "m").mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 8, "hidden_size": 16}')
    assert config_json(str(model))["hidden_size"] == 16


def test_a_setting_deepspeeds_reader_refuses_is_named_before_the_model_loads(tmp_path):
    """DeepSpeed reads its config in deepspeed.initialize, after the model is loaded and warm-started: a key it does not
    know stopped a job there with "cannot load model ...: 1 validation error for DeepSpeedZeroConfig", naming neither
    the file nor the key. Its reader now runs on the resolved config in the plan's checks, each problem named by path."""
    from elsa_ds.settings.config import DEMO_MODEL_DIR
    from tests.conftest import run_entry

    for change, needle in (({"zero_optimization": {"stage": 3, "foo_bar": 1}},
                            '"zero_optimization.foo_bar": DeepSpeed knows no such setting'),
                           ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": "maybe"}}},
                            '"zero_optimization.offload_param.pin_memory"="maybe"'),
                           ({"nebula": {"enabled": False}}, "nebula")):  # a key DeepSpeed removed: its own error class
        path = derived_config(tmp_path, **change)
        proc = run_entry("prune.py", ["--deepspeed", str(path), "--output_dir", str(tmp_path / "o")], check=False, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
        assert str(path) in errors[0] and needle in errors[0], errors[0]
        assert "calibration" not in proc.stdout + proc.stderr and not (tmp_path / "o").exists()
        # the plan of a job that would be refused is refused alike (it printed the memory of a job that cannot start)
        est = run_entry("estimate.py", ["--deepspeed", str(path), "--model", str(DEMO_MODEL_DIR)], check=False, timeout=300)
        said = [line for line in est.stderr.splitlines() if line.startswith("elsa_ds: error")]
        assert est.returncode == 2 and len(said) == 1 and needle in said[0] and "per GPU" not in est.stdout, est.stderr[-3000:]
    # a one-shot job builds no engine: DeepSpeed never reads its config, so nothing there is refused (a review)
    run_entry("prune.py", ["--deepspeed", str(path), "--method", "magnitude", "--val_windows", "0", "--output_dir",
                           str(tmp_path / "one")], timeout=300)
    assert (tmp_path / "one" / "elsa_report.json").is_file()


def test_misspelt_elsa_key_is_named(tmp_path):
    path = derived_config(tmp_path, elsa={"sparsty": 0.5})
    _fails(["--deepspeed", str(path), "--output_dir", str(tmp_path / "o")], "sparsty", "unknown setting")


def test_nonempty_output_dir_is_kept(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _fails(["--deepspeed", "ds_configs/zero3.json", "--output_dir", str(out)], "--overwrite")
    assert (out / "precious.txt").read_text() == "keep me"


def test_output_dir_whose_parent_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    _fails(["--deepspeed", "ds_configs/zero3.json", "--output_dir", str(blocker / "runs" / "o")], "cannot create its parent directory")
    assert blocker.read_text() == "not a directory"


@pytest.mark.integration
def test_dataset_smaller_than_one_global_batch(tmp_path, tiny_model_dir):
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be, that is the question.\n\n" * 20)  # 20 paragraphs: 2 held out, 18 to train on
    _fails(["--deepspeed", "ds_configs/zero3.json", "--model", str(tiny_model_dir), "--dataset", str(small), "--seqlen", "64",
            "--output_dir", str(tmp_path / "o")], "fewer than one global batch")


@pytest.mark.integration
def test_a_run_that_reads_its_text_many_times_says_so(tmp_path, tiny_model_dir):
    """A small text and a long run: the training line says how often each sequence is read, and past
    ``REREAD_WARNING`` readings a warning names the two ways out (a walk: ``--dataset /etc`` read each of its 61
    sequences 67 times, said nowhere)."""
    import re

    from elsa_ds.jobs.training import REREAD_WARNING
    from tests.conftest import run_entry

    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be, that is the question.\n\n" * 60)
    proc = run_entry("prune.py", ["--deepspeed", "ds_configs/zero3.json", "--model", str(tiny_model_dir), "--dataset", str(small),
                                  "--seqlen", "64", "--steps", "24", "--interval", "4", "--init_mask", "none", "--val_windows",
                                  "0", "--baseline", "none", "--output_dir", str(tmp_path / "o")])
    line = re.search(r"training data .*: (\d+) sequences x 64 tokens; global batch 8 .*; 24 steps read each ([\d.]+) times",
                     proc.stdout)
    assert line, proc.stdout[-3000:]
    readings = 24 * 8 / int(line[1])
    assert float(line[2]) == pytest.approx(readings, abs=0.05) and readings > REREAD_WARNING
    warned = [ln for ln in proc.stderr.splitlines() if "each is read" in ln]
    assert len(warned) == 1 and f"read {readings:.0f} times" in warned[0] and "--dataset" in warned[0], proc.stderr[-3000:]


@pytest.mark.integration
def test_target_regex_matching_nothing(tmp_path, tiny_model_dir, text_dir):
    _fails(["--deepspeed", "ds_configs/zero3.json", "--model", str(tiny_model_dir), "--dataset", str(text_dir), "--seqlen", "64",
            "--targets", r"no_such_module\d", "--output_dir", str(tmp_path / "o")], "matches no nn.Linear")


@pytest.mark.parametrize("flags, needle", [
    (["--interval", "0"], "interval"),
    (["--lmda", "-0.1"], "lmda"),
    (["--steps", "0"], "steps"),
    (["--pattern", "2:4:8"], "N:M"),
    (["--model", "/no/such/model"], "no such directory"),
    (["--model", "tests/no_such_model"], "no such directory (tests/ is a folder here"),  # not a hub id: no 30 s of retries
    (["--dataset", "./missing.txt"], "dataset='./missing.txt': no such file"),  # before the plan's logs
    (["--nsamples", "0"], "nsamples"),
])
def test_bad_numbers_and_paths_are_named(tmp_path, flags, needle):
    _fails(["--deepspeed", "ds_configs/zero3_offload.json", *flags, "--output_dir", str(tmp_path / "o")], needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.integration
def test_empty_dataset(tmp_path, tiny_model_dir):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "empty.txt").write_text("")
    _fails(["--deepspeed", "ds_configs/zero3_offload.json", "--model", str(tiny_model_dir), "--dataset", str(tmp_path / "data"),
            "--seqlen", "64", "--output_dir", str(tmp_path / "o")], "fewer than one global batch")


@pytest.mark.parametrize("flags,needles", [
    (["--sparsity", "0"], ("sparsity 0 prunes nothing", "--method dense")),
    (["--sparsity", "70%"], ("--sparsity", "'70%'", "elsa-prune --help")),  # one line, not argparse's whole usage
    (["--betas", "0.9", "1.5"], ("betas", "[0, 1)")),
    (["--method", "sparsegpt", "--lmda", "0.1", "--interval", "4"], ("--interval, --lmda", "method sparsegpt", "drop them")),
    (["--method", "wanda", "--z_dtype", "fp8"], ("--z_dtype", "wanda")),
], ids=["sparsity-0", "percent", "betas", "elsa-flags-sparsegpt", "elsa-flag-wanda"])
def test_settings_checked_for_meaning(tmp_path, flags, needles):
    """Values of the right type that the run cannot honour: refused before anything starts, the output never made."""
    out = tmp_path / "o"
    _fails(["--deepspeed", "ds_configs/zero3_offload.json", *flags, "--output_dir", str(out)], *needles)
    assert not out.exists() and not list(tmp_path.glob(".o.*"))


def test_elsa_settings_in_the_json_do_not_block_a_one_shot_method():
    """The shipped ELSA-L config carries z_dtype/u_dtype in its "elsa" block: a one-shot run with it is not refused."""
    import argparse

    from elsa_ds.cli import prune_parser, settings_from_args

    args = prune_parser().parse_args(["--deepspeed", "ds_configs/zero3_offload_elsal.json", "--method", "wanda",
                                      "--output_dir", "unused"])
    assert isinstance(args, argparse.Namespace)
    _, cfg, _ = settings_from_args(args)
    assert cfg.method.value == "wanda"


def test_corrupt_parquet_dataset_is_one_line(tmp_path, tiny_model_dir):
    bad = tmp_path / "data.parquet"
    bad.write_bytes(b"PAR1 but not really parquet")
    _fails(["--deepspeed", "ds_configs/zero3_offload.json", "--model", str(tiny_model_dir), "--dataset", str(bad),
            "--init_mask", "none", "--seqlen", "64", "--output_dir", str(tmp_path / "o")], "data.parquet", "not a readable Parquet file")
    assert [p.name for p in tmp_path.iterdir()] == ["data.parquet"]  # no output, staging or lock left


def test_hub_dataset_without_network_is_one_line(tmp_path, tiny_model_dir):
    """The default dataset of every non-demo model is c4: offline it is one line saying to give a local file."""
    from tests.conftest import run_entry

    proc = run_entry("prune.py", ["--deepspeed", "ds_configs/zero3_offload.json", "--model", str(tiny_model_dir), "--dataset",
                                  "c4", "--init_mask", "none", "--seqlen", "64", "--output_dir", str(tmp_path / "o")], check=False,
                     timeout=300,
                     env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "'c4'" in errors[0] and "local file" in errors[0], errors


def test_a_model_that_is_not_a_causal_lm_is_refused_as_such(tmp_path):
    """A BERT masked LM (transformers would load it into BertLMHeadModel with a warning): refused by prune.py and
    evaluate.py, naming what it is."""
    from transformers import BertConfig, BertForMaskedLM

    from tests.conftest import run_fails

    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(bert)
    _fails(["--deepspeed", "ds_configs/zero3_offload.json", "--model", str(bert), "--targets", r"intermediate\.dense",
            "--output_dir", str(tmp_path / "o")], "BertForMaskedLM", "not a causal language model")
    run_fails("evaluate.py", ["--model", str(bert), "--ppl", "wikitext2"], "BertForMaskedLM", "not a causal language model")
    assert not (tmp_path / "o").exists()


@pytest.mark.integration
def test_init_mask_of_another_shape_or_without_zeros_is_refused_before_loading(tmp_path, tiny_model_dir, ragged_model_dir,
                                                                                 text_dir):
    """--init_mask is read from headers (names, shapes) and one row per weight (zeros) before the model loads: a folder
    of another model and a dense folder are one line each."""
    args = ["--deepspeed", "ds_configs/zero3_offload.json", "--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "o")]
    _fails([*args, "--init_mask", str(ragged_model_dir)], "does not fit this model", "shape differs")
    _fails([*args, "--init_mask", str(tiny_model_dir)], "no zeros")
    # and a pruned folder of this model passes the check (the warm start then reads it)
    from tests.conftest import run_entry

    pruned = tmp_path / "magnitude"
    fast = ["--dataset", str(text_dir), "--seqlen", "64", "--micro_batch", "2", "--val_windows", "0", "--baseline", "none"]
    run_entry("prune.py", [*args[:4], *fast, "--method", "magnitude", "--sparsity", "0.6", "--output_dir", str(pruned)])
    proc = run_entry("prune.py", [*args, *fast, "--init_mask", str(pruned), "--sparsity", "0.6", "--steps", "2", "--lr", "1e-3"])
    assert (tmp_path / "o" / "elsa_report.json").exists()
    said = proc.stdout + proc.stderr  # the folder's mask alone: x from the dense model, said once, with the flag that changes it
    assert said.count(f"z starts from that folder's mask, x from the dense weights of {tiny_model_dir}") == 1
    assert "add --init_weights" in said
    assert "read each" not in said and "each is read" not in said  # two plays, 2 steps of 8: no sequence read twice


def test_a_tied_output_head_is_refused_as_a_target(tmp_path):
    """A thirteenth audit: --targets lm_head on the demo (tie_word_embeddings) trained the whole run, pruning the
    embedding it shares, then failed the export's check ("lm_head.weight has None zeros"). Refused before any work."""
    line = _fails(["--deepspeed", "ds_configs/zero3_offload.json", "--targets", "lm_head", "--steps", "2", "--output_dir",
                   str(tmp_path / "o")], "--targets prunes lm_head.weight, which is tied to model.embed_tokens.weight")
    assert "narrow --targets" in line and not (tmp_path / "o").exists()


def test_sparsegpts_block_must_hold_whole_groups(tmp_path):
    """A thirteenth audit: --pattern 2:4 --blocksize 6 ended in a ValueError traceback after calibration, and under ELSA
    (whose rule starts from SparseGPT's model) from rank 0's warm start, the user never having asked for SparseGPT."""
    base = ["--deepspeed", "ds_configs/zero3_offload.json", "--pattern", "2:4", "--blocksize", "6", "--output_dir", str(tmp_path / "o")]
    _fails([*base, "--method", "sparsegpt"], "--blocksize 6: SparseGPT prunes 2:4 a block of columns at a time",
           "give a multiple of 4")
    _fails([*base, "--init_mask", "sparsegpt"], "SparseGPT (its warm start, --init_mask sparsegpt)")


def test_a_singular_hessian_is_one_line_naming_the_flags():
    """A thirteenth audit: --percdamp 0 with fewer calibration tokens than a layer's inputs raised a ValueError."""
    from elsa_ds.errors import ElsaError
    from elsa_ds.oneshot.sparsegpt import sparsify_weight

    hessian = torch.ones(8, 8)  # one calibration direction over 8 inputs: rank 1, its second pivot exactly 0 (a review)
    with pytest.raises(ElsaError, match=r"not positive definite after damping 0 \(--percdamp\).*raise --percdamp"):
        sparsify_weight(torch.randn(4, 8), hessian, 0.5, blocksize=8, percdamp=0)
    new, keep, _ = sparsify_weight(torch.randn(4, 8), hessian, 0.5, blocksize=8, percdamp=0.01)
    assert int((~keep).sum()) == 16


def test_the_methods_edges_are_refused_or_said(tmp_path):
    """A thirteenth audit, values accepted that break the method without a word: a λ so large that the penalty's
    gradient overflows Adam's second moment (the Fisher mask became "the first k entries"), an eps that is 0 in fp32
    (0/0 where a gradient is 0), a profile that prunes nothing; and λ 0, which turns the penalty off (a warning)."""
    from elsa_ds.settings.config import ElsaConfig
    from elsa_ds.settings.config_checks import schedule_oddities

    base = ["--deepspeed", "ds_configs/zero3.json", "--output_dir", str(tmp_path / "o")]
    _fails([*base, "--lmda", "1e22"], "lmda 1e+22 is past 1000, this project's bound", "give lmda 1000 or less")
    _fails([*base, "--eps", "1e-50"], "eps 1e-50 is below 1e-30", "give eps 1e-30 or more")
    (profile := tmp_path / "p.json").write_text('{".*": 0.0}')
    _fails([*base, "--method", "magnitude", "--sparsity_profile", str(profile)], "gives every pruned layer 0: it prunes nothing")
    said = schedule_oddities(ElsaConfig(lmda=0.0, steps=64, interval=8))
    assert len(said) == 1 and said[0].startswith("lmda 0: the penalty") and "give lmda above 0" in said[0]
    assert not schedule_oddities(ElsaConfig(lmda=0.01, steps=64, interval=8))
