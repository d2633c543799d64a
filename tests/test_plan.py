"""The plan (``elsa_ds/plan``): every setting finished before a job is built, the way from the command line down the
layers only, and nothing after it resolving a setting again."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from elsa_ds.errors import ElsaError
from elsa_ds.plan import Plan, make_plan, read_settings
from elsa_ds.settings.config import DEMO_MODEL_DIR
from elsa_ds.settings.options import JobOptions
from tests import structure_rules as rules

ROOT = Path(__file__).resolve().parent.parent
ENGINE_BUILDERS = ("elsa_ds.zero.engine", "elsa_ds.zero.finetune_engine", "elsa_ds.zero.dist")


def _plan_edges() -> dict[str, str]:
    """Every module a module of elsa_ds/plan imports (at any depth), with where."""
    graph = rules.import_graph(ROOT)
    return {target: where for module, edges in graph.items() if module.split(".")[:2] == ["elsa_ds", "plan"]
            for target, where in edges.items() if not target.startswith("elsa_ds.plan")}


def test_the_plan_sits_below_the_jobs_and_imports_nothing_above_it_or_that_builds_an_engine():
    own = rules.layer_of("elsa_ds.plan")
    assert own is not None and own < rules.layer_of("elsa_ds.jobs") < rules.layer_of("elsa_ds.cli")
    edges = _plan_edges()
    assert edges, "the plan's imports were not found"
    above = [f"{where}: {target}" for target, where in edges.items() if (rules.layer_of(target) or 0) > own]
    assert above == []
    assert [t for t in edges if t.startswith(ENGINE_BUILDERS)] == []


def test_the_settings_go_from_the_entry_points_through_the_plan_to_the_jobs():
    graph = rules.import_graph(ROOT)
    for surface in ("elsa_ds.cli", "elsa_ds.api", "elsa_ds.jobs.owner"):
        assert "elsa_ds.plan" in graph[surface], surface
    assert {"elsa_ds.plan"} <= set(graph["elsa_ds.jobs.elsa"]) and {"elsa_ds.plan"} <= set(graph["elsa_ds.jobs.finetune"])


def test_no_job_resolves_a_setting_again():
    """The defaults rule, the checks, the DeepSpeed JSON's resolution and settings copies happen in the plan alone."""
    found = []
    # evaluate.py is the evaluation runner: no plan, its own EvalSettings (and a Path.resolve the match would count)
    for path in sorted(p for p in (ROOT / "elsa_ds" / "jobs").glob("*.py") if p.name != "evaluate.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in ("apply_defaults", "before_work", "resolve", "engine_config", "model_copy", "resolve_config", "make_plan"):
                found.append(f"{path.name}: {name}")
    assert sorted(set(found)) == ["owner.py: make_plan"]  # the job's owner makes the plan once, under the output's lock


@pytest.fixture
def demo_plan(tmp_path, monkeypatch) -> Plan:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    opts = JobOptions(deepspeed="zero3_offload", output_dir=tmp_path / "out")
    cfg, ds_config = read_settings(opts, {"steps": 64})
    return make_plan(cfg, opts, ds_config)


def test_a_plan_is_finished_and_frozen(demo_plan):
    plan = demo_plan
    assert Path(plan.cfg.model).resolve() == DEMO_MODEL_DIR and plan.world_size == 1 and plan.trains
    assert plan.defaults["applied"] and set(plan.defaults["applied"]) <= set(plan.defaults["why"])  # the rule, and why
    assert all(getattr(plan.cfg, k) == v or getattr(getattr(plan.cfg, k), "value", None) == v
               for k, v in plan.defaults["applied"].items())
    ds = plan.ds.raw  # resolved for the engine: the batch split derived, no "auto" left, no elsa block
    assert ds["gradient_accumulation_steps"] == ds["train_batch_size"] // ds["train_micro_batch_size_per_gpu"]
    assert "elsa" not in ds and "auto" not in repr(ds)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cfg = plan.cfg.model_copy(update={"steps": 1})  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.world_size = 2  # type: ignore[misc]


def test_a_retraining_plan_runs_its_own_steps_and_a_one_shot_plan_refuses_resume(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    opts = JobOptions(deepspeed="zero3_offload", output_dir=tmp_path / "out")
    cfg, ds_config = read_settings(opts, {"method": "magnitude", "finetune": "full", "finetune_steps": 24, "steps": 64})
    assert make_plan(cfg, opts, ds_config).cfg.steps == 24
    resumed = JobOptions(deepspeed="zero3_offload", output_dir=tmp_path / "out", resume=True)
    cfg, ds_config = read_settings(resumed, {"method": "magnitude"})
    with pytest.raises(ElsaError, match="has no checkpoints"):
        make_plan(cfg, resumed, ds_config)


@pytest.mark.parametrize("given, said", [
    ({"method": "magnitude", "lr": 1e-3, "steps": 10, "lora_rank": 4, "nsamples": 8, "baseline": "none", "seed": 3},
     ["--steps, --lr (method magnitude without --finetune trains nothing)", "--lora_rank (they shape --finetune lora's",
      "--nsamples (magnitude pruning reads no calibration data)", "--baseline (it is the model ELSA's"]),
    ({"method": "wanda", "finetune": "full", "finetune_steps": 3, "steps": 50, "lora_alpha": 8.0, "nsamples": 4, "percdamp": 0.5},
     ["--steps (--finetune_steps counts", "--lora_alpha (", "--percdamp (Wanda's pass has no blocks"]),
    ({"steps": 8, "interval": 2, "keep_checkpoints": 5, "eval_include_path": "."},
     ["--keep_checkpoints (no checkpoint is written", "--eval_include_path (it holds"]),
    # --val_dataset decides whether --dataset keeps a held-out part, --batch_size resolves the JSON's batch: both read
    ({"method": "magnitude", "val_windows": 0, "val_dataset": "shakespeare", "batch_size": 4, "micro_batch": 2}, []),
    ({"method": "sparsegpt", "nsamples": 8, "blocksize": 64, "percdamp": 0.1, "seqlen": 64, "val_windows": 4}, []),
    ({"method": "magnitude", "finetune": "lora", "steps": 8, "lr": 1e-4, "lora_rank": 4, "save_interval": 4, "keep_checkpoints": 1}, []),
    ({"steps": 8, "nsamples": 8, "blocksize": 64, "save_interval": 4, "keep_checkpoints": 1}, []),  # the rule's warm start
    ({"steps": 8, "nsamples": 8, "lr": 1e-3}, ["--nsamples (ELSA's dense start (an lr or start set by you, a recipe or "
                                               "the JSON keeps the paper's) calibrates no"]),
    ({"steps": 4096, "sparsity": 0.9, "percdamp": 0.1}, ["--percdamp (ELSA's dense start (the defaults rule's"]),  # long
    ({"steps": 8, "sparsity": 0.95, "blocksize": 64}, ["--blocksize (ELSA's dense start (the defaults rule's"]),  # > 90 %
    # SparseGPT reads all three, whatever ELSA's rule would do at that sparsity and budget (the review)
    ({"method": "sparsegpt", "sparsity": 0.95, "nsamples": 8}, []),
    ({"method": "sparsegpt", "finetune": "full", "lr": 1e-4, "finetune_steps": 8, "nsamples": 8, "percdamp": 0.1}, []),
    ({"method": "sparsegpt", "steps": 4096, "finetune": "lora", "blocksize": 64}, []),
    ({"steps": 8, "sparsity_profile": "PROFILE", "nsamples": 8}, []),  # a profile's ratio needs the model: may start pruned
    ({"steps": 8, "init_mask": "none", "nsamples": 8, "percdamp": 0.1}, ["--nsamples, --percdamp (--init_mask none calibrates no"]),
    ({"steps": 8, "init_mask": "wanda", "nsamples": 8, "blocksize": 64}, ["--blocksize (Wanda's warm start has no blocks"]),
    ({"steps": 8, "init_mask": "sparsegpt", "nsamples": 8, "blocksize": 64, "percdamp": 0.1}, []),
])
def test_settings_given_that_the_job_does_not_read_are_said(tmp_path, monkeypatch, caplog, given, said):
    """An audit (2026-12-07): a one-shot job took --lr, --steps, --lora_rank and --blocksize without a word (its report
    recording them as if used), a retraining job's --steps vanished beside --finetune_steps. Said as one warning (scripts
    pass one flag set to every method); a job that reads all it is given says nothing."""
    import logging

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    opts = JobOptions(deepspeed="zero3_offload", output_dir=tmp_path / "out")
    (tmp_path / "profile.json").write_text('{"mlp": 0.95}')
    with caplog.at_level(logging.WARNING, logger="elsa_ds"):
        read_settings(opts, {k: str(tmp_path / "profile.json") if v == "PROFILE" else v for k, v in given.items()})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not read by this job")]
    assert len(lines) == (1 if said else 0) and all(part in lines[0] for part in said), lines


def test_a_finished_run_is_this_job_when_only_the_rule_s_values_or_newer_settings_differ(tmp_path):
    """--resume_if_any over a finished run (``plan/finished.py``): the same settings are nothing to do; a value the
    defaults rule filled in for both runs is the same command's (the rule may have changed since: an upgrade, a
    checkpoint's kept value), a setting the report predates is taken at its default; a setting given differently is
    refused, named."""
    import json

    from elsa_ds.plan import planned_settings
    from elsa_ds.plan.checks import model_source
    from elsa_ds.plan.finished import finished_run

    out = tmp_path / "out"
    out.mkdir()
    opts = JobOptions(deepspeed="zero3_offload", output_dir=out, resume_if_any=True, finished=True)

    def job(**given):
        cfg, _ = read_settings(opts, {"steps": 64, **given})
        return cfg

    planned, defaults, world = planned_settings(job(), opts, model_source(job(), opts))
    assert "lr" in defaults["applied"]
    written = {"config": planned.model_dump(mode="json"), "world_size": world, "defaults": defaults}

    def report(**config):
        (out / "elsa_report.json").write_text(json.dumps({**written, "config": {**written["config"], **config}}))

    report()
    assert finished_run(job(), opts)[1] == planned
    report(lr=planned.lr * 2)  # the rule's value then; unset now too
    finished_run(job(), opts)
    with pytest.raises(ElsaError, match=r"other settings \(that run vs this one: .*\blr "):
        finished_run(job(lr=planned.lr), opts)  # given now: the run had another lr
    config = dict(written["config"])
    del config["leaf_layers"]  # a report written before the setting existed
    (out / "elsa_report.json").write_text(json.dumps({**written, "config": config}))
    finished_run(job(), opts)
    with pytest.raises(ElsaError, match="leaf_layers false vs true"):
        finished_run(job(leaf_layers=True), opts)
    report(sparsity=0.5)
    with pytest.raises(ElsaError, match=r"sparsity 0.5 vs 0.7"):
        finished_run(job(), opts)
    # JSON's true is not 1: a report's number where this job has a boolean, or the reverse, is another setting
    for given, match in (({"leaf_layers": 0}, "leaf_layers 0 vs false"), ({"seed": False}, "seed false vs 0")):
        report(**given)
        with pytest.raises(ElsaError, match=match):
            finished_run(job(), opts)
    report(seed=0.0)  # one number type: 0.0 is 0
    finished_run(job(), opts)


def test_resume_if_any_without_checkpoints_is_warned_about(tmp_path, monkeypatch, caplog):
    """A walk: --resume_if_any alone (no --save_interval) was taken without a word; every requeued attempt of such a job
    starts over. A one-shot job, which has no checkpoints, is not warned about."""
    import logging

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    opts = JobOptions(deepspeed="zero3_offload", output_dir=tmp_path / "out", resume_if_any=True)
    for given, warned in (({"steps": 64}, True), ({"steps": 64, "save_interval": 16}, False), ({"method": "magnitude"}, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            cfg, ds_config = read_settings(opts, given)
            make_plan(cfg, opts, ds_config)
        assert ("--resume_if_any without --save_interval" in caplog.text) == warned, given


def test_the_nvme_refusals_advice_followed_gets_past_them(tmp_path, monkeypatch):
    """An audit (2026-12-07): "use zero3_offload or drop --select_every" with --nvme_path kept ran into "--nvme_path is
    given, but this DeepSpeed config offloads nothing to NVMe ... use zero3_nvme", back to the first refusal. Each NVMe
    refusal says to leave --nvme_path out, and doing as it says plans the job."""
    from elsa_ds.zero.checkpoint import check_supported
    from elsa_ds.zero.ds_config import DsConfig

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    given = {"steps": 64, "select_every": 8, "nvme_path": str(tmp_path)}
    nvme = JobOptions(deepspeed="zero3_nvme", output_dir=tmp_path / "out")
    cfg, ds_config = read_settings(nvme, given)
    with pytest.raises(ElsaError, match=r"use zero3_offload \(without --nvme_path\) or drop --select_every"):
        make_plan(cfg, nvme, ds_config)
    with pytest.raises(ElsaError, match=r"use zero3_offload.json \(without --nvme_path\) for resumable runs"):
        check_supported(DsConfig.load("zero3_nvme"))
    offload = JobOptions(deepspeed="zero3_offload", output_dir=tmp_path / "out")
    cfg, ds_config = read_settings(offload, {k: v for k, v in given.items() if k != "nvme_path"})
    assert make_plan(cfg, offload, ds_config).cfg.select_every == 8


def test_finetune_steps_on_an_elsa_job_is_told_the_whole_way_out():
    """An audit (2026-12-07): "set --finetune full or lora" alone on an ELSA job led to "finetune retrains a one-shot
    mask ... ELSA trains on its own": the refusal names the method too, and doing as it says is taken."""
    from elsa_ds.settings.config import resolve_config

    with pytest.raises(ElsaError, match=r"set --finetune full or lora with a one-shot --method \(magnitude, wanda, "
                                        r"sparsegpt\) or dense, or drop it"):
        resolve_config({}, {"model": "m", "finetune_steps": 8})
    assert resolve_config({}, {"model": "m", "finetune_steps": 8, "finetune": "full", "method": "magnitude"}).finetune_steps == 8
