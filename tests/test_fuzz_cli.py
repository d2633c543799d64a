"""The command line's promise under random input: ``elsa-prune`` either gets as far as starting the job (exit 0 here,
where the job itself is replaced by a recorder) or stops with exit 2 and exactly one ``elsa_ds: error`` line, never a
traceback, and leaves every file as it was (locks and staging included).

A seeded generator draws flag combinations from valid and invalid values of the flags users get wrong (numbers out of
range or of the wrong type, contradicting methods and patterns, missing, corrupt and overlapping paths, --overwrite and
--resume on existing outputs). It runs ``elsa_ds.cli.main_prune`` in this process (each case in milliseconds), so it
holds everything before the job to the promise; what happens inside a job is the other tests' business."""
from __future__ import annotations

import contextlib
import io
import random

import elsa_ds.jobs.owner as owner
from elsa_ds import cli
from elsa_ds.data import hub_texts
from elsa_ds.settings.config_checks import ELSA_ONLY

SEED, CASES = 20261126, 300

# flag -> (valid values, invalid values); a value is a list of argv words, or a callable of the paths
CHOICES = {
    "--sparsity": (["0.5", "0.9"], ["0", "1.0", "-0.1", "70%", "abc", "nan"]),
    "--steps": (["4"], ["0", "-3", "four", "1e3"]),
    "--interval": (["2"], ["0", "x"]),
    "--lmda": (["0.01"], ["-0.1", "inf"]),
    "--betas": (["0.9 0.99"], ["0.9 1.5", "0.9", "-0.1 0.9"]),
    "--method": (["elsa", "wanda", "sparsegpt", "magnitude"], ["bogus", "dense"]),
    "--pattern": (["unstructured", "2:4"], ["5:4", "2-4", "0:4"]),
    "--init_mask": (["none", "sparsegpt"], ["{missing}", "{model}"]),
    "--finetune": (["full"], ["bogus"]),
    "--z_dtype": (["fp8", "bf16"], ["fp64"]),
    "--seqlen": (["64"], ["0", "-64"]),
    "--lr": (["1e-3"], ["0", "-1e-3"]),
    "--dataset": (["{text}"], ["{missing}", "{corrupt}", "{out}"]),
    "--model": (["{model}"], ["{missing}", "{out}", "{text}"]),
    "--targets": ([r"mlp\.(up|down)_proj"], ["(unclosed", "nothing_matches_this"]),
}
SWITCHES = ["--overwrite", "--resume"]


def _tree(root) -> dict[str, tuple[int, int]]:
    """Every path under ``root``; files with size and modification time (a folder's own time moves with any entry made
    and removed in it, which a lock taken and released does)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (0, 0)
            for p in sorted(root.rglob("*"))}


def _draw(rng: random.Random, paths: dict[str, str]) -> list[str]:
    argv = ["--deepspeed", "ds_configs/zero3_offload.json", "--output_dir", paths[rng.choice(["out", "out", "full", "inside"])]]
    for flag in rng.sample(list(CHOICES), rng.randint(1, 5)):
        valid, invalid = CHOICES[flag]
        value = rng.choice(invalid if rng.random() < 0.4 else valid)
        argv += [flag, *value.format(**paths).split()]
    argv += [s for s in SWITCHES if rng.random() < 0.25]
    if "--model" not in argv:
        argv += ["--model", paths["model"]]
    if "--seqlen" not in argv:  # the tiny model's positions are fewer than the default's: the plan would refuse every case
        argv += ["--seqlen", "64"]
    return argv


def test_random_flags_give_exit_0_or_one_line_and_change_nothing(tmp_path, tiny_model_dir, text_dir, monkeypatch):
    started = []
    monkeypatch.setattr(owner, "make_job", lambda plan: (plan.cfg, plan.opts))  # the finished plan reaches the job
    monkeypatch.setattr(owner, "run_job", lambda job, mark=None: started.append(job) or None)
    # the flags are drawn here, not the network: the tiny model's default dataset (c4) is taken for reachable, as on a
    # user's machine (offline and uncached it is refused before work: tests/data/test_hub_texts.py)
    monkeypatch.setattr(hub_texts, "hub_unreachable", lambda: None)
    full = tmp_path / "full"
    full.mkdir()
    (full / "precious.txt").write_text("an earlier result")
    (full / "elsa_report.json").write_text("{}")  # an earlier job's: --overwrite may replace it
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not parquet at all")
    paths = {"model": str(tiny_model_dir), "text": str(text_dir), "missing": str(tmp_path / "missing"), "corrupt": str(corrupt),
             "out": str(tmp_path / "out"), "full": str(full), "inside": str(tiny_model_dir / "pruned")}
    watched = (tmp_path, tiny_model_dir, text_dir)
    rng, outcomes = random.Random(SEED), {0: 0, 2: 0}
    for case in range(CASES):
        argv = _draw(rng, paths)
        before = [_tree(r) for r in watched]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main_prune(argv)
            except SystemExit as stop:  # argparse (one line, see OneLineParser)
                code = stop.code
        lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("elsa_ds: error")]
        where = f"case {case}: {' '.join(argv)}\n{err.getvalue()[-2000:]}"
        assert code in (0, 2), where
        assert "Traceback" not in err.getvalue(), where
        assert len(lines) == (1 if code == 2 else 0), where
        assert [_tree(r) for r in watched] == before, where
        if code == 0:  # what reached the job means something: the settings the refusals exist for
            cfg, opts = started[-1]
            assert 0 < cfg.sparsity < 1 and all(0 <= b < 1 for b in cfg.betas) and cfg.steps > 0, where
            assert tiny_model_dir not in opts.output_dir.resolve().parents or cfg.model != str(tiny_model_dir), where
            assert not any(f"--{k}" in argv for k in ELSA_ONLY) or cfg.method.value == "elsa", where
        outcomes[code] += 1
    print(f"{CASES} cases (seed {SEED}): {outcomes[0]} reached the job, {outcomes[2]} refused with one line")
    assert outcomes[0] >= CASES // 20 and outcomes[2] >= CASES // 2, outcomes  # the generator exercises both sides
