"""A report is built from the record a job fills and the exported files, nothing else (``elsa_ds/jobs/report.py``)."""
from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import save_file

from elsa_ds.errors import ElsaError
from elsa_ds.jobs.report import ReportRecord, elsa_report, finetune_report, oneshot_report
from elsa_ds.settings.config import resolve_config

LAYER = "model.layers.0.mlp.down_proj.weight"
VALIDATION = {"source": "text", "part": "held out", "documents": 3, "text_tokens": 900, "windows": 4, "seqlen": 8,
              "protocol": {"name": "stream", "requested": "auto", "layout": "concatenated"}}


def _staged(tmp_path, zeros: int):
    """An exported model directory with one 4x8 pruned layer holding ``zeros`` zeros."""
    weight = torch.arange(1, 33, dtype=torch.float32).view(4, 8)
    weight.view(-1)[:zeros] = 0
    save_file({LAYER: weight}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _record(label: str = "elsa", **settings) -> ReportRecord:
    cfg = resolve_config({}, {"model": "toy", "steps": 4, "interval": 2, "seqlen": 8, "sparsity": 0.5, **settings})
    return ReportRecord(cfg=cfg, method=label, deepspeed="zero3_offload", world=2, started=time.time() - 5,
                        validation=VALIDATION, goals=cfg.layer_goals({LAYER: (4, 8)}), expected_zeros={LAYER: 16})


def test_the_elsa_report_reads_the_record_and_the_exported_files(tmp_path):
    rec = _record()
    rec.final_ppl, rec.dense_ppl, rec.baseline_ppl = 20.0, 15.0, 40.0
    rec.losses, rec.step_times, rec.global_batch = [4.0, 3.0, 2.0, 1.0], [9.0, 1.0, 2.0, 3.0], 16
    rec.history = [{"step": 2, "lambda": 0.1, "residual": 0.5, "admm_state_bytes_per_param": 8.0, "final": False},
                   {"step": 4, "lambda": 0.2, "residual": 0.0, "admm_state_bytes_per_param": 8.0, "final": True}]
    report = elsa_report(rec, _staged(tmp_path, 16))
    assert report["tokens"] == 4 * 16 * 8 and report["world_size"] == 2 and report["deepspeed_config"] == "zero3_offload"
    assert report["step_time_s"] == 2.0  # the first step (lazy state) left out
    assert report["final_loss"] == 1.0 and report["final_loss_mean_last_interval"] == 1.5
    assert report["lambda"] == 0.2 and report["residual"] == 0.5  # the last projection's λ; the last non-final residual
    assert report["ppl"]["magnitude_oneshot"] == 40.0 and report["ppl"]["warm_start"] is None
    assert report["vs_magnitude"] == {"ppl_ratio": 2.0, "ppl_reduction": 20.0}
    assert report["layers"][LAYER]["zeros"] == 16 and report["overall_sparsity"] == 0.5
    assert report["ppl"]["windows"] == 4 and report["ppl"]["validation"]["source"] == "text"


def test_a_report_refuses_an_export_that_misses_the_layout(tmp_path):
    with pytest.raises(ElsaError, match="has 15 zeros, expected 16"):
        elsa_report(_record(), _staged(tmp_path, 15))


def test_the_retraining_and_oneshot_reports_read_their_own_fields(tmp_path):
    staging = _staged(tmp_path, 16)
    rec = _record("wanda", method="wanda", finetune="full")
    rec.losses, rec.step_times, rec.global_batch, rec.baseline_ppl, rec.final_ppl = [2.0, 1.0], [5.0, 1.0], 4, 30.0, 25.0
    tuned = finetune_report(rec, staging)
    assert tuned["ppl"]["before_finetune"] == 30.0 and tuned["ppl"]["pruned"] == 25.0 and tuned["tokens"] == 4 * 4 * 8
    assert tuned["final_loss_mean_tail"] == 1.5 and tuned["tail_steps"] == 2  # a 2-step run: its 2 steps, said (an audit)
    rec.expected_zeros = {}  # the dense control: nothing to verify
    assert finetune_report(rec, staging)["layers"] == {}
    one = _record("wanda", method="wanda")
    one.calibration, one.device, one.prune_s = {"sequences": 3}, "cpu", 1.5
    report = oneshot_report(one, staging)
    assert report["tokens"] == 3 * 8 and report["device"] == "cpu" and report["world_size"] == 2


def test_an_elsa_run_ending_worse_than_its_pruned_start_says_what_to_change(tmp_path, capsys):
    """A run whose perplexity ends above its warm start's (a user's 4-step smoke run: 722 -> 3122 at the rule's lr)
    ends with a warning naming the lr, whose it is, and what to pass; a run that gains says nothing of the kind."""
    from elsa_ds.jobs.report import print_summary
    from elsa_ds.log import setup_logging

    setup_logging("info", rank=0)
    for final, warned in ((60.0, True), (30.0, False)):
        rec = _record(init_mask="sparsegpt", init_weights=True, lr=1e-3)
        rec.final_ppl, rec.dense_ppl, rec.baseline_ppl = final, 15.0, 40.0
        rec.losses, rec.step_times, rec.global_batch = [4.0, 3.0, 2.0, 1.0], [9.0, 1.0, 2.0, 3.0], 16
        print_summary(elsa_report(rec, _staged(tmp_path, 16)), tmp_path)
        err = capsys.readouterr().err
        assert ("worse than the pruned model it started from: your lr 0.001 is likely too large for 4 steps; pass a "
                "smaller --lr (e.g. 0.00025) or more --steps" in err) == warned, err
    rec = _record(init_mask="sparsegpt", init_weights=True, lr=1e-3)  # as the rule sets them (apply_defaults' record):
    rec.defaults = {"applied": {"lr": 1e-3, "init_mask": "sparsegpt", "init_weights": True}}  # the advice keeps the start
    rec.final_ppl, rec.dense_ppl, rec.baseline_ppl = 60.0, 15.0, 40.0
    rec.losses, rec.step_times, rec.global_batch = [4.0, 3.0, 2.0, 1.0], [9.0, 1.0, 2.0, 3.0], 16
    print_summary(elsa_report(rec, _staged(tmp_path, 16)), tmp_path)
    assert f"the defaults rule's lr {rec.cfg.lr:g}" in (err := capsys.readouterr().err)
    assert f"(e.g. {rec.cfg.lr / 4:.2g}) with --init_mask {rec.cfg.init_mask} --init_weights (without them" in err, err


def test_a_summary_without_a_baseline_names_none(tmp_path, capsys):
    """--baseline none (or a skipped one-shot): the line gives dense and ELSA, not "one-shot magnitude None" (a walk)."""
    from elsa_ds.jobs.report import print_summary
    from elsa_ds.log import setup_logging

    setup_logging("info", rank=0)
    rec = _record()
    rec.final_ppl, rec.dense_ppl, rec.baseline_ppl = 20.0, 15.0, None
    rec.losses, rec.step_times, rec.global_batch = [4.0, 3.0], [9.0, 1.0], 16
    print_summary(elsa_report(rec, _staged(tmp_path, 16)), tmp_path)
    out = capsys.readouterr().out
    assert "dense 15.000 | ELSA 20.000" in out and "None" not in out


def test_a_summary_without_a_dense_model_and_a_retraining_worse_than_its_start(tmp_path, capsys):
    """ELSA from a pruned folder (no dense model to score) still prints its perplexity and the check against its start
    (a walk: the console ended at "wrote"); a retraining run ending above its start is warned as ELSA is."""
    from elsa_ds.jobs.report import print_summary
    from elsa_ds.log import setup_logging

    setup_logging("info", rank=0)
    rec = _record(init_mask="sparsegpt", init_weights=True, lr=1e-3)
    rec.final_ppl, rec.dense_ppl, rec.baseline_ppl = 60.0, None, 40.0
    rec.losses, rec.step_times, rec.global_batch = [4.0, 3.0, 2.0, 1.0], [9.0, 1.0, 2.0, 3.0], 16
    print_summary(elsa_report(rec, _staged(tmp_path, 16)), tmp_path)
    captured = capsys.readouterr()
    assert "protocol): warm start (sparsegpt) 40.000 | ELSA 60.000" in captured.out and "dense None" not in captured.out
    assert "ELSA ended worse than the pruned model it started from" in captured.err
    tuned = _record("wanda", method="wanda", finetune="full", lr=1e-3)
    tuned.losses, tuned.step_times, tuned.global_batch, tuned.baseline_ppl, tuned.final_ppl = [2.0, 1.0], [5.0, 1.0], 4, 30.0, 35.0
    print_summary(finetune_report(tuned, _staged(tmp_path, 16)), tmp_path)
    err = capsys.readouterr().err
    assert "fine-tuning ended worse than the pruned model it started from: your lr 0.001" in err
    assert "or more --finetune_steps" in err, err  # the retraining's own count (an audit: "--steps")


@pytest.mark.parametrize("start, said", [(40.0, "1.333x lower than its warm start (sparsegpt)"),
                                         (30.0, "the same as its warm start (sparsegpt) (to 0.1 %)"),
                                         (30.01, "the same as its warm start"), (29.99, "the same as its warm start"),
                                         (20.0, "1.500x HIGHER than its warm start")])
def test_elsa_against_its_warm_start_in_words(tmp_path, capsys, start, said):
    """An audit (2026-12-07): an export that was its warm start unchanged read "1.000x lower than its warm start"; a
    ratio of 0.9996 would have read "1.000x HIGHER". Equal to the digits shown, it is the same."""
    from elsa_ds.jobs.report import print_summary
    from elsa_ds.log import setup_logging

    setup_logging("info", rank=0)
    rec = _record(init_mask="sparsegpt", init_weights=True, lr=1e-3)
    rec.final_ppl, rec.dense_ppl, rec.baseline_ppl = 30.0, 15.0, start
    rec.losses, rec.step_times, rec.global_batch = [4.0, 3.0], [9.0, 1.0], 16
    print_summary(elsa_report(rec, _staged(tmp_path, 16)), tmp_path)
    out = capsys.readouterr().out
    assert f"ELSA perplexity is {said}" in out, out


def test_perplexities_computed_in_other_dtypes_are_said_in_the_line(tmp_path, capsys):
    """An audit (2026-12-07): on a CPU-only machine the warm start's dense model is scored on rank 0's fp32 copy and the
    warm start and ELSA on the bf16 engine; the line says which figure was computed how, and says nothing when one
    arithmetic computed all."""
    from elsa_ds.jobs.report import print_summary
    from elsa_ds.log import setup_logging

    setup_logging("info", rank=0)
    engine, host = "bfloat16 on the engine", "float32 in rank 0's one-shot pass"
    for dense, said in ((host, True), (engine, False)):
        rec = _record(init_mask="sparsegpt", init_weights=True, lr=1e-3)
        rec.final_ppl, rec.dense_ppl, rec.baseline_ppl = 30.0, 15.0, 40.0
        rec.losses, rec.step_times, rec.global_batch = [4.0, 3.0], [9.0, 1.0], 16
        rec.computed_in = {"dense": dense, "warm_start": engine, "pruned": engine}
        report = elsa_report(rec, _staged(tmp_path, 16))
        assert report["ppl"]["computed_in"] == rec.computed_in
        print_summary(report, tmp_path)
        out = capsys.readouterr().out
        note = (f"ELSA 30.000 (dense in {host}, warm start in {engine}, ELSA in {engine}: the fourth digit may differ)")
        assert (note in out) == said, out
    rec.baseline_ppl = None  # --baseline none, or skipped: a figure not measured has no arithmetic to name (the review)
    assert elsa_report(rec, _staged(tmp_path, 16))["ppl"]["computed_in"] == {"dense": engine, "pruned": engine}
