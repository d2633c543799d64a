"""The defaults rule (elsa_ds/settings/defaults.py) and its application to the settings a user left unset."""
from __future__ import annotations

import json
import math

import pytest

from elsa_ds.admm.schedule import LambdaSchedule
from elsa_ds.models import load_config
from elsa_ds.plan.defaults_applied import apply_defaults
from elsa_ds.settings.config import DEMO_MODEL_DIR, resolve_config
from elsa_ds.settings.defaults import ANCHORS, REF_STEPS, elsa_settings, pretraining_lr, retrain_settings
from elsa_ds.zero.checkpoint import resume_changes


@pytest.mark.parametrize("anchor", ANCHORS, ids=lambda a: a["source"])
def test_reproduces_the_papers_settings(anchor):
    for sparsity, (low, high) in anchor["lr"].items():
        assert low <= elsa_settings(anchor["n_params"], sparsity, anchor["steps"]).values["lr"] <= high, sparsity
    for sparsity, (low, high) in anchor["lmda"].items():
        assert low <= elsa_settings(anchor["n_params"], sparsity, anchor["steps"]).values["lmda"] <= high, sparsity


def test_paper_schedule_cosine_at_high_sparsity_constant_below_and_linear_for_short_budgets():
    schedule = lambda s, t: elsa_settings(6.74e9, s, t).values["lmda_schedule"]  # noqa: E731
    assert schedule(0.9, 4096) is LambdaSchedule.cosine and schedule(0.7, 4096) is LambdaSchedule.cosine
    assert schedule(0.6, 4096) is LambdaSchedule.constant
    # short budgets: a linear ramp from 0 at >= 80 % (it won at 90 %, lost at 70 %), constant below
    assert schedule(0.9, 400) is LambdaSchedule.linear and schedule(0.8, 400) is LambdaSchedule.linear
    assert schedule(0.95, 2047) is LambdaSchedule.linear and schedule(0.95, 2048) is LambdaSchedule.cosine
    assert schedule(0.7, 400) is LambdaSchedule.constant and schedule(0.5, 400) is LambdaSchedule.constant


def test_larger_steps_for_shorter_budgets_higher_sparsity_and_smaller_models():
    lr = lambda n, s, t: elsa_settings(n, s, t, start_pruned=False).values["lr"]  # noqa: E731  (from the dense weights)
    assert lr(4e6, 0.9, 400) > lr(4e6, 0.9, 4096)
    assert lr(4e6, 0.95, 400) > lr(4e6, 0.9, 400) > lr(4e6, 0.7, 400) > lr(4e6, 0.5, 400)
    assert lr(4e6, 0.9, 400) > lr(13e6, 0.9, 400) > lr(7e9, 0.9, 400) > lr(27e9, 0.9, 400)
    assert elsa_settings(4e6, 0.9, 400).values["lmda"] > elsa_settings(4e6, 0.5, 400).values["lmda"]
    assert retrain_settings(4e6, 400).values["lr"] > retrain_settings(4e6, 4096).values["lr"] > retrain_settings(7e9, 4096).values["lr"]
    assert pretraining_lr(6.74e9) == pytest.approx(3e-4, rel=0.1)  # Llama-2-7B's pre-training peak


def test_the_budget_factor_grows_no_further_below_the_shortest_budget_measured():
    """Below MIN_RULE_STEPS (100) the lr is the 100-step one, for ELSA and retraining alike, and says so: a 4-step run
    at the factor grown on (8x) ended worse than its one-shot start (a user's walk, 2026-11-30)."""
    from elsa_ds.settings.defaults import MIN_RULE_STEPS

    for start_pruned in (False, None):
        short, edge = (elsa_settings(268e6, 0.9, t, start_pruned=start_pruned) for t in (4, MIN_RULE_STEPS))
        assert short.values["lr"] == edge.values["lr"] and "grows no further" in short.why["lr"]
        assert "grows no further" not in edge.why["lr"]
    assert retrain_settings(268e6, 4).values["lr"] == retrain_settings(268e6, MIN_RULE_STEPS).values["lr"]
    assert elsa_settings(268e6, 0.9, 200, start_pruned=False).values["lr"] < elsa_settings(268e6, 0.9, 100, start_pruned=False).values["lr"]


def test_a_warm_up_of_a_tenth_comes_with_short_budgets_only():
    for s in (elsa_settings(4e6, 0.9, 400), retrain_settings(4e6, 400)):
        assert s.values["warmup_steps"] == 40
    assert elsa_settings(4e6, 0.5, 12).values["warmup_steps"] == 1
    assert elsa_settings(6.74e9, 0.9, 4096).values["warmup_steps"] == 0 == retrain_settings(6.74e9, 2048).values["warmup_steps"]
    assert elsa_settings(4e6, 0.9, 2047).values["warmup_steps"] == 205


def test_every_value_says_why():
    for s in (elsa_settings(4e6, 0.9, 400), retrain_settings(4e6, 400)):
        assert set(s.why) == set(s.values) and all(s.why.values())


def test_the_schedules_reason_quotes_the_thresholds_it_was_decided_by(monkeypatch):
    import elsa_ds.settings.defaults as rule
    why = lambda s, t: elsa_settings(4e6, s, t).why["lmda_schedule"]  # noqa: E731
    assert why(0.9, 400).startswith("linear") and "80%" in why(0.9, 400) and "2048" in why(0.9, 400)
    assert why(0.75, 400).startswith("constant") and "below 80%" in why(0.75, 400)
    assert why(0.6, 400) == "constant: sparsity below 70% (the paper's setting)" and why(0.9, 4096).startswith("cosine")
    monkeypatch.setattr(rule, "LINEAR_FROM", 0.85)
    monkeypatch.setattr(rule, "COSINE_FROM", (0.65, 1024))
    assert "85%" in why(0.9, 400) and "1024" in why(0.9, 400) and "below 85%" in why(0.8, 400)
    assert "below 65%" in why(0.6, 400) and why(0.9, 1024).startswith("cosine")


def _demo(resumed=None, **given):
    cfg = resolve_config({}, {"model": str(DEMO_MODEL_DIR), **given})
    return apply_defaults(cfg, load_config(str(DEMO_MODEL_DIR)), resumed)


def test_applied_only_to_fields_the_user_left_unset():
    cfg, record = _demo(sparsity=0.9, steps=400)
    expected = elsa_settings(record["inputs"]["n_params"], 0.9, 400).values
    assert (cfg.lr, cfg.lmda, cfg.lmda_schedule) == (expected["lr"], expected["lmda"], expected["lmda_schedule"])
    assert set(record["applied"]) == {"lr", "lmda", "lmda_schedule", "warmup_steps", "init_mask", "init_weights", "hold_steps"}
    assert cfg.hold_steps == 200  # 90 %, 400 steps, the pruned start with retraining's lr: the last half inside the mask
    assert record["set_by_user"] == []
    assert cfg.warmup_steps == 40 and (cfg.init_mask, cfg.init_weights) == ("sparsegpt", True)  # 90 %, 400 steps: the pruned start
    json.dumps(record)  # goes into the report as is
    cfg, record = _demo(sparsity=0.9, steps=400, lr=5e-4)  # a user's lr: no warm-up the user did not ask for
    assert cfg.lr == 5e-4 and set(record["applied"]) == {"lmda", "lmda_schedule"} and record["set_by_user"] == ["lr"]
    assert cfg.warmup_steps == 0 and cfg.hold_steps == 0  # the paper's dense start, the paper's end
    cfg, record = _demo(sparsity=0.9, steps=400, warmup_steps=7)
    assert cfg.warmup_steps == 7 and "warmup_steps" not in record["applied"] and record["set_by_user"] == ["warmup_steps"]


def test_the_rule_takes_a_profiles_ratios_not_the_sparsity_they_replace(tmp_path):
    """An audit (2026-12-07): a profile of 0.9 for every layer got the rule's 70 % settings (λ, a constant schedule) from
    --sparsity's default. The rule's sparsity is the profile's, each layer weighted by its size."""
    from elsa_ds.models import meta_model
    from elsa_ds.targets import select_targets

    (every := tmp_path / "every.json").write_text(json.dumps({"proj": 0.9}))
    cfg, record = _demo(sparsity_profile=str(every), steps=400)
    same, _ = _demo(sparsity=0.9, steps=400)
    assert record["inputs"]["sparsity"] == pytest.approx(0.9) and (cfg.lmda, cfg.lmda_schedule) == (same.lmda, same.lmda_schedule)
    (mlp := tmp_path / "mlp.json").write_text(json.dumps({"mlp": 0.95}))
    _, record = _demo(sparsity_profile=str(mlp), sparsity=0.5, steps=400)
    meta = meta_model(load_config(str(DEMO_MODEL_DIR)))
    sizes = {n: p.numel() for n, p in meta.named_parameters() if n in set(select_targets(meta, None).values())}
    in_mlp = sum(v for n, v in sizes.items() if ".mlp." in n)
    assert 0 < in_mlp < sum(sizes.values())
    assert record["inputs"]["sparsity"] == pytest.approx((0.95 * in_mlp + 0.5 * (sum(sizes.values()) - in_mlp)) / sum(sizes.values()))
    (head := tmp_path / "head.json").write_text(json.dumps({"lm_head": 0.5}))  # the demo's lm_head is tied to its embedding
    _, record = _demo(sparsity_profile=str(head), targets="lm_head|mlp", sparsity=0.9, steps=400)  # a KeyError (a review)
    assert 0.5 < record["inputs"]["sparsity"] < 0.9


def test_recipe_and_json_block_count_as_set():
    cfg = resolve_config({"elsa": {"lmda": 0.07}}, {"model": str(DEMO_MODEL_DIR)}, recipe={"lr": 1e-5, "lmda_schedule": "linear"})
    cfg, record = apply_defaults(cfg, load_config(str(DEMO_MODEL_DIR)))
    assert (cfg.lr, cfg.lmda, cfg.lmda_schedule) == (1e-5, 0.07, LambdaSchedule.linear) and record["applied"] == {}


def test_retraining_and_dense_control_get_the_retraining_lr():
    cfg, record = _demo(method="wanda", finetune="full", sparsity=0.9, steps=400)
    assert cfg.lr == retrain_settings(record["inputs"]["n_params"], 400).values["lr"] and set(record["applied"]) == {"lr", "warmup_steps"}
    assert cfg.warmup_steps == 40
    cfg, record = _demo(method="dense", finetune="lora", finetune_steps=200)
    assert record["inputs"] == {"n_params": record["inputs"]["n_params"], "sparsity": 0.0, "steps": 200}
    assert cfg.lr == retrain_settings(record["inputs"]["n_params"], 200).values["lr"]


def test_short_budgets_up_to_90_percent_start_from_sparsegpt_with_the_budget_factor_dropped():
    start = lambda s, t: elsa_settings(4e6, s, t).values.get("init_mask")  # noqa: E731
    assert start(0.7, 400) == "sparsegpt" and start(0.5, 2047) == "sparsegpt" and elsa_settings(4e6, 0.7, 400).values["init_weights"]
    assert start(0.8, 400) == start(0.9, 400) == start(0.9, 100) == "sparsegpt" and start(0.95, 400) is None
    assert start(0.9, 2048) is None and start(0.7, 2048) is None and start(0.5, 4096) is None
    factor = (REF_STEPS / 400) ** 0.3
    dense_start = elsa_settings(4e6, 0.7, 400, start_pruned=False).values["lr"]
    assert elsa_settings(4e6, 0.7, 400).values["lr"] == pytest.approx(dense_start / factor, rel=0.01)
    assert elsa_settings(4e6, 0.7, 400, start_pruned=True).values["lr"] == elsa_settings(4e6, 0.7, 400).values["lr"]
    assert "init_mask" not in elsa_settings(4e6, 0.7, 400, start_pruned=True).values  # the user's start, not the rule's
    # past the paper's budget the factor is below 1 and stays, pruned start or not
    assert elsa_settings(4e6, 0.7, 8192, start_pruned=True).values["lr"] == elsa_settings(4e6, 0.7, 8192).values["lr"]
    assert set(elsa_settings(4e6, 0.7, 400).why) == set(elsa_settings(4e6, 0.7, 400).values)


def test_a_pruned_start_from_80_percent_takes_retrainings_lr_where_it_is_larger():
    n = 268.1e6  # Gemma-3 270M
    retrain = lambda t: retrain_settings(n, t).values["lr"]  # noqa: E731
    pruned = lambda s, t: elsa_settings(n, s, t).values["lr"]  # noqa: E731  (the rule's start: pruned, t < 2048)
    assert pruned(0.9, 100) == retrain(100) > 1.5 * elsa_settings(n, 0.7, 100).values["lr"] / math.exp(1.6 * -0.2)
    assert pruned(0.8, 100) == pytest.approx(retrain(100) * math.exp(1.6 * -0.1), rel=0.01)  # the sparsity factor stays
    assert pruned(0.9, 2000) > retrain(2000) and pruned(0.9, 2000) == pruned(0.9, 1000)  # longer: ELSA's own is larger
    assert "retraining rule" in elsa_settings(n, 0.9, 100).why["lr"] and "retraining" not in elsa_settings(n, 0.7, 100).why["lr"]
    assert elsa_settings(n, 0.9, 100, start_pruned=True).values["lr"] == retrain(100)  # the user's pruned start too
    assert elsa_settings(n, 0.9, 100, start_pruned=False).values["lr"] > 1.9 * retrain(100)  # the dense start keeps its own


def test_the_rules_start_comes_with_the_rules_lr_and_gives_way_to_the_users():
    cfg, record = _demo(sparsity=0.7, steps=400)
    assert (cfg.init_mask, cfg.init_weights) == ("sparsegpt", True) and {"init_mask", "init_weights"} <= set(record["applied"])
    assert cfg.lr == elsa_settings(record["inputs"]["n_params"], 0.7, 400).values["lr"] and cfg.warmup_steps == 40
    cfg, record = _demo(sparsity=0.7, steps=400, lr=5e-4)  # a user's lr: the paper's dense start
    assert cfg.init_mask is None and not cfg.init_weights and "init_mask" not in record["applied"]
    cfg, record = _demo(sparsity=0.7, steps=400, init_mask="none")  # no warm start, said explicitly
    assert cfg.init_mask is None and not cfg.init_weights and record["set_by_user"] == ["init_mask"]
    n = record["inputs"]["n_params"]
    assert cfg.lr == elsa_settings(n, 0.7, 400, start_pruned=False).values["lr"]  # the dense start's larger steps
    cfg, record = _demo(sparsity=0.7, steps=400, init_mask="wanda")  # z from Wanda, x dense: the dense start's lr
    assert (cfg.init_mask, cfg.init_weights, cfg.lr) == ("wanda", False, elsa_settings(n, 0.7, 400, start_pruned=False).values["lr"])
    cfg, record = _demo(sparsity=0.9, steps=400, init_mask="sparsegpt", init_weights=True)  # the user's pruned start at 90 %
    assert cfg.lr == elsa_settings(n, 0.9, 400, start_pruned=True).values["lr"] < elsa_settings(n, 0.9, 400, False).values["lr"]
    assert "init_mask" not in record["applied"] and record["set_by_user"] == ["init_mask", "init_weights"]
    cfg, record = _demo(method="wanda", finetune="full", sparsity=0.7, steps=400)  # retraining has its own mask
    assert cfg.init_mask is None and "init_mask" not in record["applied"]


def test_a_pruned_start_with_retrainings_lr_ends_its_last_half_inside_the_mask():
    hold = lambda s, t, start=None: elsa_settings(268.1e6, s, t, start).values.get("hold_steps", 0)  # noqa: E731
    assert hold(0.9, 100) == 50 and hold(0.8, 400) == 200 and hold(0.8 - 1e-12, 400) == 200
    assert hold(0.7, 100) == 0 and hold(0.95, 100) == 0  # below 80 %: the paper's end; above 90 %: the dense start's
    assert hold(0.9, 500) == 0 and hold(0.9, 2047) == 0  # from ~450 steps ELSA's own lr, and the paper's end
    assert hold(0.9, 100, False) == 0 and hold(0.9, 100, True) == 50  # the user's pruned start too, not the dense one
    for t in range(3, 2048, 7):  # the held end comes exactly with retraining's lr
        values = elsa_settings(268.1e6, 0.9, t).values
        assert ("hold_steps" in values) == (values["lr"] == retrain_settings(268.1e6, t).values["lr"]), t
    assert "inside the mask" in elsa_settings(268.1e6, 0.9, 100).why["hold_steps"]
    assert "hold_steps" not in elsa_settings(268.1e6, 0.7, 100).why and hold(0.9, 1) == 0  # half of one step: nothing to hold
    cfg, record = _demo(sparsity=0.9, steps=100)
    assert cfg.hold_steps == 50 and record["applied"]["hold_steps"] == 50
    cfg, record = _demo(sparsity=0.9, steps=100, hold_steps=0)  # the paper's end, asked for
    assert cfg.hold_steps == 0 and "hold_steps" not in record["applied"] and record["set_by_user"] == ["hold_steps"]
    cfg, record = _demo(sparsity=0.9, steps=100, select_every=10, val_windows=4)  # selection keeps its own end
    assert cfg.hold_steps == 0


def test_the_rules_held_end_leaves_its_admm_steps_a_z_u_update():
    """A new user's walk (2026-12-02): at 64 steps the rule's half left 32 ADMM steps, no z, u update at the default
    interval 32, and the job warned of settings the user had not set. The held end is shortened to leave one."""
    from elsa_ds.settings.config_checks import schedule_oddities

    cfg, _ = _demo(sparsity=0.9, steps=20, interval=32)  # no hold leaves an update: the rule's, and the warning says why
    assert cfg.hold_steps == 10 and "end before the first projection" in schedule_oddities(cfg)[0]
    for steps, interval, held in ((64, 32, 31), (128, 32, 64), (40, 32, 7), (33, 32, 0), (64, 8, 32)):
        cfg, record = _demo(sparsity=0.9, steps=steps, interval=interval)
        assert cfg.hold_steps == held, (steps, interval)
        assert not schedule_oddities(cfg), (steps, interval)
        assert ("first z, u update" in record["why"]["hold_steps"]) == (held != round(steps / 2)), (steps, interval)


def test_a_resume_compares_paths_by_their_place_and_the_demo_model_by_name(tmp_path, monkeypatch):
    """A walk (2026-12-02): a moved or reinstalled elsa_ds refused to resume its own demo run (the demo model's absolute
    path in the fingerprint, a model the user never named), ``m`` and ``./m`` were different settings, and the same
    relative path from another folder, naming another model, was taken as the same."""
    import shutil

    from elsa_ds.settings.config import DEMO_MODEL_DIR, ElsaConfig

    for folder in ("a", "b"):
        shutil.copytree(DEMO_MODEL_DIR, tmp_path / folder / "m")
        (tmp_path / folder / "texts").mkdir()
        (tmp_path / folder / "texts" / "a.txt").write_text("a text to train on\n")
    monkeypatch.chdir(tmp_path / "a")
    written = ElsaConfig(model="m", dataset="./texts", init_mask="sparsegpt").resume_fingerprint(1)
    for same in ("./m", str(tmp_path / "a" / "m"), "../a/m"):
        assert resume_changes(written, ElsaConfig(model=same, dataset="texts/../texts", init_mask="sparsegpt")
                              .resume_fingerprint(1)) is None, same
    monkeypatch.chdir(tmp_path / "b")
    assert "model" in resume_changes(written, ElsaConfig(model="m", dataset="./texts", init_mask="sparsegpt").resume_fingerprint(1))
    old_install = {**written, "model": "/gone/elsewhere/elsa_ds/demo/model", "dataset": "shakespeare"}  # as typed before
    assert resume_changes(old_install, ElsaConfig(model=str(DEMO_MODEL_DIR), dataset="shakespeare", init_mask="sparsegpt")
                          .resume_fingerprint(1)) is None
    old_relative = {**written, "model": "m", "dataset": "../a/texts"}  # an older checkpoint's relative paths, read from here
    assert resume_changes(old_relative, ElsaConfig(model="./m", dataset=str(tmp_path / "a" / "texts"), init_mask="sparsegpt")
                          .resume_fingerprint(1)) is None
    assert ElsaConfig(model="google/gemma-2-2b").resume_fingerprint(1)["model"] == "google/gemma-2-2b"  # a hub id as given


def test_a_resumed_run_keeps_the_rule_values_it_started_with_where_the_rule_changed_since():
    fresh, _ = _demo(sparsity=0.9, steps=100)
    written = fresh.resume_fingerprint(1)
    assert _demo(written, sparsity=0.9, steps=100)[0] == fresh  # the same rule: nothing kept, nothing changed
    # a checkpoint from before the held end existed (no hold_steps key), with another lr and λ schedule
    old = {k: v for k, v in written.items() if k != "hold_steps"} | {"lr": 1.23e-4, "lmda_schedule": "constant"}
    cfg, record = _demo(old, sparsity=0.9, steps=100)
    assert (cfg.hold_steps, cfg.lr, cfg.lmda_schedule) == (0, 1.23e-4, LambdaSchedule.constant)
    assert cfg.resume_fingerprint(1) == {**old, "hold_steps": 0}  # so the resume check finds nothing changed
    assert record["applied"]["hold_steps"] == 0 and record["applied"]["lmda_schedule"] == "constant"
    assert "kept from the checkpoint" in record["why"]["hold_steps"] and "now be 50" in record["why"]["hold_steps"]
    assert record["kept_from_checkpoint"] == ["hold_steps", "lmda_schedule", "lr"]
    assert cfg.lmda == fresh.lmda and cfg.init_mask == fresh.init_mask  # unchanged fields stay the rule's
    # what the user sets is the user's: a changed setting is still refused by the resume check, not silently undone
    cfg, record = _demo(old, sparsity=0.9, steps=100, hold_steps=20, lr=2e-4)
    assert (cfg.hold_steps, cfg.lr) == (20, 2e-4) and "hold_steps" not in record["applied"]
    assert "hold_steps 0 vs 20" in resume_changes(old, cfg.resume_fingerprint(1))
    said = resume_changes(old, cfg.resume_fingerprint(1), "--resume_if_any")  # the flag given, and what to do (a walk)
    assert said.startswith("--resume_if_any with changed settings") and said.endswith("--overwrite in place of --resume_if_any")
    # a checkpoint that did not record its warm-up: its lr is not kept alone (one schedule), so the resume is refused
    cfg, _ = _demo({k: v for k, v in old.items() if k != "warmup_steps"}, sparsity=0.9, steps=100)
    assert cfg.lr == fresh.lr and "lr 0.000123 vs" in resume_changes(old, cfg.resume_fingerprint(1))
    # a held end does not come back beside --select_every, and a damaged value is not kept (the resume check says why)
    cfg, _ = _demo(written | {"hold_steps": 30}, sparsity=0.9, steps=100, select_every=10, val_windows=4)
    assert cfg.hold_steps == 0
    cfg, record = _demo(written | {"lr": "not a number"}, sparsity=0.9, steps=100)
    assert cfg.lr == fresh.lr and "kept" not in record["why"].get("lr", "")
    # nor one of the right type that ElsaConfig refuses (an eighth audit: lr -1.0 was kept, the job loaded, then refused)
    for key, bad in (("lr", -1.0), ("lr", float("inf")), ("lmda", float("inf")), ("warmup_steps", -5), ("warmup_steps", True),
                     ("hold_steps", -3), ("hold_steps", 10**400)):
        cfg, record = _demo(written | {key: bad}, sparsity=0.9, steps=100)
        assert key not in record["kept_from_checkpoint"] and getattr(cfg, key) == getattr(fresh, key), (key, bad)
        assert f"{key} {bad!r}"[:20] in resume_changes(written | {key: bad}, cfg.resume_fingerprint(1)), (key, bad)
    # JSON's true is not 1 (Python's 1 == True had a checkpoint's "freeze_embeddings": 0 pass as this job's false)
    for key, value in (("freeze_embeddings", int(fresh.freeze_embeddings)), ("init_weights", int(fresh.init_weights)),
                       ("seed", bool(fresh.seed))):
        assert f"{key} {value!r}" in resume_changes(written | {key: value}, fresh.resume_fingerprint(1)), (key, value)
    assert resume_changes(written | {"seed": float(fresh.seed)}, fresh.resume_fingerprint(1)) is None  # one number type
    # a checkpoint with a held end the rule no longer gives keeps it too
    cfg, record = _demo(written | {"hold_steps": 30}, sparsity=0.9, steps=100)
    assert cfg.hold_steps == 30 and "now be 50" in record["why"]["hold_steps"]
