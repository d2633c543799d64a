"""Every shipped recipe parses, validates against ElsaConfig, cites its source and converts λ as the authors' trainer
applies it (paper λ / W); a recipe reaches the job through --recipe below the command line."""
from __future__ import annotations

import json

import pytest

from elsa_ds.cli import prune_parser, settings_from_args
from elsa_ds.settings.config import ElsaConfig, load_recipe
from elsa_ds.settings.config_files import recipe_dir

RECIPES = sorted(recipe_dir().glob("*.json"))


def test_recipes_are_shipped_and_linked():
    assert RECIPES, "no recipe ships"
    assert (recipe_dir().parent.parent / "recipes").resolve() == recipe_dir()  # the top-level recipes/ symlink


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_matches_its_paper_values(path):
    raw = json.loads(path.read_text())
    settings = load_recipe(path.stem)                    # unknown settings are an error there
    cfg = ElsaConfig(**settings)                         # every value validates
    assert "2510.01650" in raw["source"] and "table" in raw["source"]
    paper, world = raw["paper"], raw["conversion"]["world_size"]
    assert cfg.lmda == pytest.approx(paper["lmda"] / world) and cfg.lr == paper["lr"] and cfg.sparsity == paper["sparsity"]
    assert (cfg.batch_size, cfg.steps) == (paper["batch_size"], paper["steps"])
    extreme = cfg.sparsity >= 0.7                        # the paper: cosine from 0 and 8 x 4096 at 70-90 %, else constant, 32 x 1024
    assert cfg.lmda_schedule.value == ("cosine" if extreme else "constant") and paper["lmda_schedule"].startswith(cfg.lmda_schedule.value)
    assert (cfg.batch_size, cfg.steps) == ((8, 4096) if extreme else (32, 1024))
    assert cfg.betas == (0.9, 0.95) and cfg.dataset == "c4" and cfg.sampling.value == "crop" and cfg.seqlen == 2048
    assert path.stem == f"{cfg.model.split('/')[-1].lower()}-s{round(cfg.sparsity * 100)}"


def test_help_shows_the_data_flags():
    text = prune_parser().format_help()  # argparse %-formats help: a docstring's "10%" must not break --help
    assert all(flag in text for flag in ("--recipe", "--sampling", "--val_dataset", "--ppl_protocol", "10%"))


def test_recipe_below_the_command_line():
    args = prune_parser().parse_args(["--deepspeed", "zero3_offload", "--output_dir", "out/x", "--recipe", "gemma-2-27b-s90",
                                      "--lmda", "5e-4"])
    _, cfg, _ = settings_from_args(args)
    assert cfg.model == "google/gemma-2-27b" and cfg.lr == 2e-5 and cfg.lmda == 5e-4 and cfg.batch_size == 8


def test_a_recipe_for_another_model_is_taken_with_a_warning(caplog, tmp_path):
    """A walk: --recipe gemma-2-27b-s90 --model google/gemma-2-9b took 27B's lr and λ without a word."""
    from elsa_ds.log import setup_logging
    from elsa_ds.plan import elsa_settings
    from elsa_ds.zero.ds_config import DsConfig

    setup_logging("info", rank=0)
    caplog.set_level("WARNING", logger="elsa_ds")
    ds = DsConfig.load("zero3_offload")
    cfg = elsa_settings(ds, "zero3_offload", "gemma-2-27b-s90", {"model": "google/gemma-2-9b", "lr": 1e-4})
    assert cfg.lr == 1e-4 and cfg.lmda == 1e-3
    said = [r.getMessage() for r in caplog.records if "was written for" in r.getMessage()]
    assert said == ["recipe gemma-2-27b-s90 was written for google/gemma-2-27b; --model google/gemma-2-9b takes its settings as "
                    "they are (lmda, steps, batch_size: that model's; pass your own, or leave the recipe out for the defaults rule)"]
    caplog.clear()
    elsa_settings(ds, "zero3_offload", "gemma-2-27b-s90", {})
    assert not [r for r in caplog.records if "was written for" in r.getMessage()]
    # the model's own download in a folder (a cluster's disk) is the model the recipe was written for (a walk)
    import shutil

    from elsa_ds.models import SHIPPED_CONFIGS

    for hub_id, warned in (("google/gemma-2-27b", False), ("google/gemma-2-9b", True)):
        local = tmp_path / hub_id.replace("/", "_")
        local.mkdir()
        shutil.copy(SHIPPED_CONFIGS / hub_id / "config.json", local / "config.json")
        caplog.clear()
        elsa_settings(ds, "zero3_offload", "gemma-2-27b-s90", {"model": str(local)})
        assert bool([r for r in caplog.records if "was written for" in r.getMessage()]) == warned, hub_id


def test_the_log_says_which_values_a_recipe_gave_and_which_were_set_over_it(caplog):
    """The resolved config shows the values, not where they came from: a recipe's are named once, with what the command
    line or the JSON's elsa block set over them (a leftover of the last session's walk)."""
    from elsa_ds.log import setup_logging
    from elsa_ds.plan import elsa_settings
    from elsa_ds.zero.ds_config import DsConfig

    setup_logging("info", rank=0)
    caplog.set_level("INFO", logger="elsa_ds")
    ds = DsConfig.load("zero3_offload")
    ds.raw["elsa"] = {"interval": 16}
    elsa_settings(ds, "zero3_offload", "gemma-2-27b-s90", {"lr": 1e-4, "steps": None})
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("from recipe")]
    assert len(said) == 1 and said[0].startswith("from recipe gemma-2-27b-s90: model google/gemma-2-27b, dataset c4")
    assert "steps 4096" in said[0] and "lmda 0.001" in said[0] and " lr 2e-05" not in said[0]
    assert said[0].endswith("; set elsewhere over it: lr (yours), interval (the JSON elsa block)")


def test_a_regex_that_could_match_in_exponential_time_is_refused_wherever_it_comes_from(tmp_path):
    """A walk (2026-12-02): a downloaded recipe's "targets": "(.|.|.)*!" held the job at 100 % CPU (and its output's lock)
    before the first step; a sparsity profile's keys are regexes too. Refused at once, naming the file; ordinary
    patterns (the default's lookahead, alternations, bounded groups) pass."""
    import time

    from elsa_ds.errors import ElsaError
    from elsa_ds.settings.config import ElsaConfig
    from elsa_ds.settings.config_files import compile_regex, load_profile
    from elsa_ds.targets import DEFAULT_TARGETS

    started = time.time()
    recipe = _recipe(tmp_path / "r", {"targets": "(.|.|.)*!"})
    args = prune_parser().parse_args(["--deepspeed", "zero3_offload", "--output_dir", "out/x", "--recipe", str(recipe)])
    with pytest.raises(ElsaError, match=rf"recipe {recipe}.*targets.*repeats a group that holds an alternation"):
        settings_from_args(args)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({r"(\\w+)+proj": 0.5}))
    with pytest.raises(ValueError, match="repeats a group"):
        load_profile(profile)
    for bad in ("(a+)+$", "(a|aa)*b", "(x*)*", "a" * 2000):
        with pytest.raises(ValueError):
            compile_regex(bad)
    assert time.time() - started < 10
    for good in (DEFAULT_TARGETS, r"layers\.\d+\.(q|k|v)_proj", r"(model\.)?layers\.[0-3]\.", ".*mlp.*", "((a|b)c)*"):
        compile_regex(good)
        assert ElsaConfig(targets=good).targets == good


def test_module_names_are_searched_with_a_time_limit_and_the_check_evasions_end_at_once(monkeypatch):
    """A second walk: patterns past ``compile_regex``'s check (a bounded repeat of an alternation, twelve wildcards in a
    row, an alternation inside a conditional group) held a job with Python's ``re``; module names are now searched by
    the ``regex`` module, which ends them at once, and any search past ``MATCH_SECONDS`` is one line naming the pattern."""
    import time

    from elsa_ds import targets
    from elsa_ds.errors import ElsaError

    name = "model.layers.10.self_attn.q_proj"
    started = time.time()
    for evasion in ("(.|.){1,40}!", ".*" * 12 + "!", "()?(?(1)(.|.)*)!"):
        assert targets.NamePattern(evasion).search(name) is None
    assert time.time() - started < 5
    assert targets.NamePattern(targets.DEFAULT_TARGETS).search(name) and not targets.NamePattern("mlp").search(name)
    shapes = {f"{name}.weight": (8, 8), "model.layers.0.mlp.up_proj.weight": (8, 8)}
    assert targets.layer_goals(shapes, 0.5, profile={"q_proj": 0.9}) == {f"{name}.weight": 0.9,
                                                                          "model.layers.0.mlp.up_proj.weight": 0.5}
    spent = targets.NamePattern("q_proj")
    monkeypatch.setattr(targets, "TOTAL_SECONDS", 0.0)  # every search of a pattern together has a budget too
    with pytest.raises(ElsaError, match=r"took more than 0 s"):
        spent.search(name)
    monkeypatch.setattr(targets, "TOTAL_SECONDS", 20.0)
    monkeypatch.setattr(targets, "MATCH_SECONDS", 1e-6)  # a search of ~1 ms now outlasts its limit (``regex`` reads the
    # clock now and then: a backreference pattern it ends in microseconds passed one name in CI and was refused at the next)
    with pytest.raises(ElsaError, match=r"took more than 1e-06 s to match the module name 'model.layers.10"):
        targets.layer_goals(shapes, 0.5, profile={r"(\w|\.)*(\w|\.)*(\w|\.)*\d{5}": 0.9})
    from elsa_ds.settings.config_files import compile_regex
    with pytest.raises(ValueError, match="nested set"):  # a POSIX class to the regex engine, a plain set to re
        compile_regex("[[:alpha:]]+_proj")


def _recipe(folder, settings: dict):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mine.json"
    path.write_text(json.dumps({"source": "a test", "settings": settings}))
    return path


def test_a_recipes_paths_are_its_folders_and_stay_inside_it(tmp_path, monkeypatch):
    """A recipe is data (a walk: "dataset": "/etc" trained on the machine's files; "prof.json" was read from the working
    directory): its local paths are read against its own folder, one outside it is refused, names are left as names."""
    from elsa_ds.errors import ElsaError

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "recipes"
    (folder / "texts").mkdir(parents=True)
    settings = load_recipe(str(_recipe(folder, {"sparsity_profile": "prof.json", "dataset": "./texts",
                                                "eval_ppl": "wikitext2,./texts", "model": "google/gemma-2-2b"})))
    assert settings["sparsity_profile"] == str(folder.resolve() / "prof.json")
    assert settings["dataset"] == str(folder.resolve() / "texts") and settings["model"] == "google/gemma-2-2b"
    assert settings["eval_ppl"] == ["wikitext2", str(folder.resolve() / "texts")]
    # a name whose first part is a folder beside the recipe is a path there, as --model out/run1 is on the command line
    (folder / "models" / "mine").mkdir(parents=True)
    settings = load_recipe(str(_recipe(folder, {"model": "models/mine", "init_mask": "models/typo", "dataset": "texts"})))
    assert settings == {k: str(folder.resolve() / v) for k, v in
                        (("model", "models/mine"), ("init_mask", "models/typo"), ("dataset", "texts"))}
    for key, value in (("dataset", "/etc"), ("sparsity_profile", "../prof.json"), ("init_mask", "~/masks"),
                       ("val_dataset", "./texts/../../elsewhere")):
        with pytest.raises(ElsaError, match=f"{key} '.*' is outside the recipe's folder.*: remove it there .* and pass "
                                            f"--{key} yourself"):  # not "pass --{key}" alone: refused the same (an audit)
            load_recipe(str(_recipe(folder, {key: value})))
    (folder / "out").symlink_to(tmp_path)  # a link out of the folder is outside it too
    with pytest.raises(ElsaError, match="outside the recipe's folder"):
        load_recipe(str(_recipe(folder, {"dataset": "./out/texts.txt"})))
    (folder / "texts" / "a.txt").write_text("inside")  # a folder read whole: a file link in it leads out too (a second audit)
    (folder / "texts" / "deep").mkdir()
    for name, to in (("deep/b.txt", tmp_path / "secret.txt"), ("deep/c", tmp_path)):
        (folder / "texts" / name).symlink_to(to)
        with pytest.raises(ElsaError, match=f"dataset './texts' holds {name}, a link to outside the recipe's folder"):
            load_recipe(str(_recipe(folder, {"dataset": "./texts"})))
        (folder / "texts" / name).unlink()
    (folder / "texts" / "deep" / "b.txt").symlink_to(folder / "texts" / "a.txt")  # a link within the folder is the recipe's own
    assert load_recipe(str(_recipe(folder, {"dataset": "./texts"})))["dataset"] == str(folder.resolve() / "texts")
    with pytest.raises(ElsaError, match="nvme_path: where this machine writes is yours to choose"):
        load_recipe(str(_recipe(folder, {"nvme_path": "/local_nvme"})))
    with pytest.raises(ElsaError, match=r"unknown settings \['lamda'\] \(a recipe may set: ") as err:
        load_recipe(str(_recipe(folder, {"lamda": 0.1})))
    assert "lmda" in str(err.value) and "nvme_path" not in str(err.value) and "eval_include_path" not in str(err.value)


def test_a_hub_id_with_dots_reaches_no_config_outside_the_shipped_ones(tmp_path):
    """An audit (2026-12-05): a recipe's ``"model": "google/../../<anywhere>"`` looked like a hub id, so it was not held
    to the recipe's folder, and joined to the shipped configs' folder it read any config.json on the disk (a JSON error
    there was a traceback). Such a name is a path now (refused outside the folder), and a shipped config is looked up
    only for an ``owner/name``."""
    from elsa_ds.errors import ElsaError
    from elsa_ds.models import SHIPPED_CONFIGS, shipped_config
    from elsa_ds.plan import same_architecture

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "config.json").write_text("{not json")
    up = "/".join([".."] * len(SHIPPED_CONFIGS.parts))
    sneaky = f"google/{up}{tmp_path}/elsewhere"
    assert (SHIPPED_CONFIGS / sneaky / "config.json").is_file()  # what the old join reached
    with pytest.raises(ElsaError, match=r"model '.*' is outside the recipe's folder"):
        load_recipe(str(_recipe(tmp_path / "recipes", {"model": sneaky})))
    for name in (sneaky, "google/..", "../google/gemma-2-27b", "google//gemma-2-27b", "google/gemma-2-27b/", "gemma-2-27b",
                 "google/gemma-2-27b/../gemma-2-9b"):
        assert shipped_config(name) is None, name
    assert shipped_config("google/gemma-2-27b") == SHIPPED_CONFIGS / "google" / "gemma-2-27b" / "config.json"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text((SHIPPED_CONFIGS / "google" / "gemma-2-27b" / "config.json").read_text())
    assert same_architecture(str(mine), "google/gemma-2-27b") and not same_architecture(str(mine), sneaky)
