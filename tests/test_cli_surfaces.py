"""elsa-estimate and elsa-evaluate take their flags from the settings models that generate elsa-prune's: a flag that
means the same thing is declared once, with one help text; comma lists are read by one parser."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from elsa_ds.cli import (ESTIMATE_SHARED, EstimateOptions, _cli_fields, estimate_parser, evaluate_parser, main_estimate,
                         main_evaluate, prune_parser)
from elsa_ds.evaluation.zeroshot import PAPER_TASKS, expand_tasks
from elsa_ds.jobs.evaluate import EvalSettings
from elsa_ds.settings.config import DEMO_MODEL_DIR, ElsaConfig, comma_list, load_recipe
from elsa_ds.settings.config_files import comma_paths
from elsa_ds.settings.options import JobOptions

PACKAGE = Path(__file__).resolve().parent.parent / "elsa_ds"
CLI_ONLY = {"--help", "--version", "--json", "--compare"}  # output switches and modes, not settings


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Visible flags by their name (--X of --X/--no-X, --help of -h/--help)."""
    return {next(o for o in a.option_strings if o.startswith("--") and not o.startswith("--no-")): a
            for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS}


def _docstring(model, name: str) -> str:
    return " ".join(model.model_fields[name].description.split())


@pytest.mark.parametrize("make", [estimate_parser, evaluate_parser], ids=["estimate", "evaluate"])
def test_every_flag_is_a_settings_field(make):
    models = (EstimateOptions, JobOptions, ElsaConfig) if make is estimate_parser else (EvalSettings, JobOptions)
    fields = {f"--{name}" for model in models for name in _cli_fields(model)}
    flags = set(_flags(make()))
    assert flags - CLI_ONLY <= fields, flags - CLI_ONLY - fields


def test_shared_flags_have_the_job_settings_help_text():
    prune = _flags(prune_parser())
    shared = [(model, name, _flags(estimate_parser())) for model, names in ESTIMATE_SHARED.items() for name in names]
    shared += [(ElsaConfig, "ppl_protocol", _flags(evaluate_parser())), (JobOptions, "log_level", _flags(evaluate_parser()))]
    assert {name for _, name, _ in shared} >= {"seqlen", "batch_size", "micro_batch", "targets", "deepspeed", "log_level"}
    for model, name, flags in shared:
        flag = f"--{name}"
        assert flags[flag].help == prune[flag].help, flag
        assert flags[flag].help.replace("%%", "%").startswith(_docstring(model, name).removesuffix("."))
        assert flags[flag].choices == prune[flag].choices and flags[flag].type == prune[flag].type


def test_evaluate_help_is_the_settings_docstrings():
    flags = _flags(evaluate_parser())
    for name in _cli_fields(EvalSettings):
        text = re.sub(r"\s*\[[^\]]*\]\.?$", "", _docstring(EvalSettings, name)).removesuffix(".")
        assert flags[f"--{name}"].help.startswith(text), name
    assert "demo" not in flags["--seqlen"].help  # the demo's profile is the pruning job's, not an evaluation's
    assert "demo: 256" in _flags(estimate_parser())["--seqlen"].help  # the estimate resolves the job's settings


def test_existing_flag_spellings_still_parse():
    est = estimate_parser().parse_args(["--model", "m", "--deepspeed", "zero3", "--num_gpus", "2", "--num_nodes", "3",
                                        "--micro_batch", "2", "--batch_size", "8", "--seqlen", "512", "--targets", "q_proj",
                                        "--no_gradient_checkpointing", "--json"])
    assert (est.num_gpus, est.num_nodes, est.micro_batch, est.batch_size, est.seqlen) == (2, 3, 2, 8, 512)
    assert est.gradient_checkpointing is False and est.json and est.targets == "q_proj"
    unset = estimate_parser().parse_args(["--model", "m", "--deepspeed", "zero3"])
    assert unset.seqlen is None and unset.gradient_checkpointing is None  # not given: the job's value applies
    ev = evaluate_parser().parse_args(["--model", "m", "--ppl", "wikitext2,c4", "--tasks", "--seqlen", "64", "--dtype", "fp32",
                                       "--device_map", "auto", "--output", "r.json", "--limit", "3", "--batch_size", "4"])
    settings = EvalSettings(**{k: v for k in _cli_fields(EvalSettings) if (v := getattr(ev, k)) is not None})
    assert settings.tasks == list(PAPER_TASKS) and settings.ppl == ["wikitext2", "c4"]
    assert (settings.seqlen, settings.dtype, settings.device_map, settings.limit, settings.batch_size) == (64, "fp32", "auto", 3, 4)
    assert settings.output == Path("r.json")
    assert prune_parser().parse_args(["--deepspeed", "z", "--output_dir", "o", "--no_gradient_checkpointing"]).gradient_checkpointing is False


def test_one_parser_for_comma_lists():
    assert comma_list(" wikitext2, c4,, ") == ["wikitext2", "c4"]
    assert ElsaConfig(eval_tasks="rte, boolq,").eval_tasks == ["rte", "boolq"]
    assert EvalSettings(model="m", ppl="c4 ,wikitext2").ppl == ["c4", "wikitext2"]
    assert expand_tasks(["rte", "", " paper"]) == ["rte", *[t for t in PAPER_TASKS if t != "rte"]]
    splitters = [f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"""\.split\(\s*["'],["']""", line)]
    assert {s.split(":")[0] for s in splitters} == {"settings/config_files.py"}, f"one place (comma_list, comma_paths): {splitters}"


def test_a_file_whose_name_holds_a_comma_is_one_entry_of_a_path_list(tmp_path, monkeypatch, capsys, tiny_model_dir):
    """A walk (2026-12-04): --eval_ppl / --ppl could not name a file with a comma, and the refusal printed the pieces joined
    back ("notes, 2026.txt: no such file"), the name the user gave. A piece that names no file is joined with the next
    while that names one; the refusal quotes each entry it read."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes,2026.txt").write_text("Some lines of text to score.\n" * 40)
    (tmp_path / "plain.txt").write_text("x\n")
    assert comma_paths("notes,2026.txt,shakespeare, plain.txt,,") == ["notes,2026.txt", "shakespeare", "plain.txt"]
    assert comma_paths("c4,wikitext2") == ["c4", "wikitext2"] and comma_paths(["a,b"]) == ["a,b"]
    (tmp_path / "notes").mkdir()  # a folder named as the file's first piece: the longer name is the one meant (a review)
    assert comma_paths("notes,2026.txt,notes") == ["notes,2026.txt", "notes"]
    recipe = tmp_path / "r" / "r.json"  # a recipe's string: its names read against its folder
    recipe.parent.mkdir()
    (recipe.parent / "val,2024.txt").write_text("x\n")
    recipe.write_text(json.dumps({"source": "a test", "settings": {"eval_ppl": "val,2024.txt,shakespeare"}}))
    assert load_recipe(str(recipe))["eval_ppl"] == [str(recipe.parent / "val,2024.txt"), "shakespeare"]
    assert ElsaConfig(eval_ppl="shakespeare,notes,2026.txt").eval_ppl == ["shakespeare", "notes,2026.txt"]
    with pytest.raises(ValidationError, match="'memo', '2027.txt': no such file or directory"):
        ElsaConfig(eval_ppl="memo,2027.txt")
    out = tmp_path / "r.json"
    assert main_evaluate(["--model", str(tiny_model_dir), "--ppl", "notes,2026.txt", "--seqlen", "16", "--output", str(out)]) == 0
    assert list(json.loads(out.read_text())["ppl"]) == ["notes,2026.txt"], out.read_text()[:400]


def test_a_list_of_many_commas_is_read_in_bounded_time(tmp_path, monkeypatch):
    """An audit (2026-12-05): every run of pieces was looked up as a file's name, so a recipe's ``eval_ppl`` of 30,000
    commas kept elsa-prune in stat calls for ~an hour before its first line. Runs are tried only while shorter than a path
    may be, and only in lists of at most MAX_JOINED_PIECES pieces (past them each piece is an entry)."""
    from elsa_ds.settings import config_files

    monkeypatch.chdir(tmp_path)
    looked = []
    real = config_files._exists
    monkeypatch.setattr(config_files, "_exists", lambda text, base=None: looked.append(len(text)) or real(text, base))
    assert comma_paths("," * 30_000) == [] and looked == []
    assert comma_paths(",".join(["a"] * 3000)) == ["a"] * 3000 and looked == []
    (tmp_path / ("a," * 20 + "b")).write_text("x")  # within the bound a file's name with commas is still found
    within = ",".join(["x"] * 200 + ["a"] * 20 + ["b"] + ["y"] * 30)
    assert comma_paths(within) == ["x"] * 200 + ["a," * 20 + "b"] + ["y"] * 30
    assert max(looked) < config_files.PATH_MAX
    looked.clear()
    assert len(comma_paths(",".join(["z" * 100] * config_files.MAX_JOINED_PIECES))) == config_files.MAX_JOINED_PIECES
    assert len(looked) <= config_files.MAX_JOINED_PIECES * (config_files.PATH_MAX // 101)  # not every run: 32,640


def test_bad_settings_are_one_error_line(capsys, tiny_model_dir):
    assert main_evaluate(["--model", str(tiny_model_dir), "--seqlen", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("elsa_ds: error: ") and "seqlen=1" in err[0]
    assert main_estimate(["--model", "google/gemma-2-2b", "--deepspeed", "zero3", "--num_gpus", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_gpus=0" in err[0]
    assert main_estimate(["--model", "google/gemma-2-2b", "--deepspeed", "zero3", "--seqlen", "1"]) == 2
    assert "seqlen=1" in capsys.readouterr().err  # validated by ElsaConfig, as elsa-prune validates it
    # a percentage for the fraction: named as such (a walk, 2026-12-02: "Input should be less than 1" alone)
    assert main_estimate(["--model", "google/gemma-2-2b", "--deepspeed", "zero3", "--sparsity", "70"]) == 2
    assert "sparsity=70.0: a fraction of zeros in [0, 1), not a percentage: 0.7 for 70 %" in capsys.readouterr().err
    # the estimate's own numbers keep to the job's rules (an audit: 10**25 GPUs was sized, an infinite network timed)
    for flags, said in ((["--num_gpus", "1" + "0" * 25], "less than or equal to 9007199254740992"),
                        (["--num_nodes", "2", "--internode_gbps", "1e400"], "internode_gbps=inf: Input should be a finite"),
                        (["--num_gpus", str(2**30), "--num_nodes", str(2**30)], "--num_gpus x --num_nodes must be at most")):
        assert main_estimate(["--model", "google/gemma-2-2b", "--deepspeed", "zero3", *flags]) == 2
        assert said in capsys.readouterr().err


def test_estimate_resolves_unset_settings_as_the_job_does(capsys):
    """Not given: the JSON's, a recipe's or the demo profile's value, as elsa-prune would run the job."""
    assert main_estimate(["--model", str(DEMO_MODEL_DIR), "--deepspeed", "zero3", "--json"]) == 0
    demo = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main_estimate(["--model", str(DEMO_MODEL_DIR), "--deepspeed", "zero3", "--json", "--seqlen", "512",
                          "--gradient_checkpointing"]) == 0
    long = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert demo["breakdown"]["activations"]["per_gpu"] < long["breakdown"]["activations"]["per_gpu"]


def test_two_nodes_name_the_network_rate_their_step_rests_on_and_take_the_users(capsys):
    """A walk (2026-12-04): two-node step times rest on a fixed 40 GB/s a rank between nodes that no flag set and the
    output never named; a cloud cluster on Ethernet would be told a fraction of its time."""
    args = ["--model", "google/gemma-2-27b", "--deepspeed", "zero3_offload_elsal", "--num_gpus", "8", "--num_nodes", "2",
            "--batch_size", "128", "--micro_batch", "1", "--seqlen", "2048", "--json"]
    steps = {}
    for extra in ([], ["--internode_gbps", "5"]):
        assert main_estimate(args + extra) == 0
        out = capsys.readouterr().out
        assert ("between nodes: 5 GB/s a rank (--internode_gbps)" if extra else "between nodes: 40 GB/s a rank (typical") in out
        steps[bool(extra)] = json.loads(out.strip().splitlines()[-1])["time"]["step_s"]
    assert steps[True] > 2 * steps[False], steps
    assert main_estimate(args[:6] + ["--num_gpus", "8"]) == 0 and "between nodes" not in capsys.readouterr().out


def test_estimate_says_what_the_job_would_about_its_schedule(capsys):
    """At 4 steps the defaults rule's interval (32) is never reached: the job warned, the estimate did not (a user's walk,
    2026-11-30). The estimate now says what the job would, and refuses what the job would refuse, in the same words."""
    job = ["--model", str(DEMO_MODEL_DIR), "--deepspeed", "zero3"]
    assert main_estimate([*job, "--steps", "4"]) == 0
    err = capsys.readouterr().err
    assert "warning: interval 32: the run's 4 ADMM steps end before the first projection" in err
    assert main_estimate([*job, "--steps", "64"]) == 0 and "first projection" not in capsys.readouterr().err
    assert main_estimate([*job, "--steps", "8", "--save_interval", "8"]) == 0
    assert "no checkpoint is written before the run ends" in capsys.readouterr().err


def test_estimate_takes_a_jobs_command_line_as_it_stands_and_says_what_it_left_out(capsys):
    """The job's time hint says to run elsa-estimate with the job's flags: --output_dir, --dataset, --nvme_path were
    refused as unrecognized (a user's walk, 2026-11-30). Every elsa-prune flag is accepted; those it does not use are
    named, and the figures are those without them."""
    job = ["--deepspeed", "zero3_offload", "--recipe", "gemma-2-27b-s90", "--num_gpus", "8", "--json"]
    assert main_estimate(job) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(_flags(prune_parser())) - {"--local_rank"} <= set(_flags(estimate_parser())) | {"--model"}
    assert main_estimate([*job, "--output_dir", "/nowhere/out", "--dataset", "c4", "--nvme_path", "/nowhere/nvme",
                          "--lmda", "0.05", "--overwrite"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1]) == plain
    line = next(x for x in (captured.out + captured.err).splitlines() if "not used by the estimate" in x)
    # --output_dir is not named: the estimate sizes what the job writes there (a user's walk found both said)
    assert {"--dataset", "--nvme_path", "--lmda", "--overwrite"} == set(line.split(": ")[-1].split(", "))
    assert main_estimate([*job, "--hold_steps", "0"]) == 0 and "not used by the estimate" in "".join(capsys.readouterr())
    for other in (["--method", "sparsegpt"], ["--method", "sparsegpt", "--finetune", "lora"]):  # a job it does not size
        assert main_estimate([*job, *other]) == 2
        assert "elsa-estimate sizes ELSA jobs, but the command line, the recipe or the JSON's elsa block sets method " \
               "sparsegpt" in capsys.readouterr().err


def test_compress_flags_are_its_settings_fields_with_the_other_entry_points_log_level():
    """elsa-compress is generated like the others: its arguments are CompressSettings' fields, --log_level is JobOptions'
    (the same levels and help as elsa-prune's), and its existing spellings still parse."""
    from elsa_ds.sparse.cli import CompressSettings, parser

    flags = _flags(parser())
    fields = _cli_fields(CompressSettings)
    positional = [a.dest for a in parser()._actions if not a.option_strings]
    assert positional == [name for name, f in fields.items() if (f.json_schema_extra or {}).get("positional")] == ["input", "output"]
    assert set(flags) - CLI_ONLY == {f"--{name}" for name in fields if name not in positional} | {"--log_level"}
    prune = _flags(prune_parser())["--log_level"]
    assert (flags["--log_level"].help, flags["--log_level"].choices) == (prune.help, prune.choices)
    assert flags["--log_level"].choices == ["debug", "info", "warning", "error"]
    for name in ("min_sparsity", "max_shard_size", "overwrite", "verify"):
        assert flags[f"--{name}"].help.startswith(_docstring(CompressSettings, name).removesuffix(".")), name
    args = parser().parse_args(["in", "out", "--min_sparsity", "0.4", "--max_shard_size", "2GB", "--overwrite", "--log_level", "warning"])
    assert (args.input, args.output, args.min_sparsity, args.max_shard_size, args.overwrite, args.verify) == (
        Path("in"), Path("out"), 0.4, "2GB", True, False)
    check = parser().parse_args(["--verify", "ckpt"])
    assert check.verify and check.output is None and check.log_level is None  # not given: JobOptions' default (info)
