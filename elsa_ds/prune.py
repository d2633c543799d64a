"""The pruning job, start to end: config -> data -> ZeRO-3 engine with ADMM -> train -> final projection
-> export -> report. ``launch/prune.py`` only parses arguments and calls ``run``.

Every rank runs this file; only rank 0 prints and writes. Collectives are marked where they happen.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from datetime import timedelta
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from elsa_ds.admm.optimizer import summarize_metrics
from elsa_ds.admm.schedule import learning_rate
from elsa_ds.config import ONESHOT_METHODS, ElsaConfig, Method, load_profile
from elsa_ds.data import GlobalBatches, load_blocks, load_tokenizer
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.perplexity import PROTOCOL, ppl
from elsa_ds.mask_file import MaskReader
from elsa_ds.memory import check_nvme_param_buffers
from elsa_ds.output import (REPORT_NAME, check_output_dir, fresh_staging, layers_summary, publish, staging_dir,
                            verified_layers, versions, write_json)
from elsa_ds.targets import layer_targets, select_targets
from elsa_ds.zero import checkpoint
from elsa_ds.zero import engine as zero

INJECT_NAN_ENV = "ELSA_DS_INJECT_NAN_STEP"  # test hook: make the loss NaN at this step


class Printer:
    """Rank-0 console output."""

    def __init__(self, rank: int):
        self.rank = rank

    def __call__(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def evaluate_windows(job: zero.ZeroJob, windows: torch.Tensor, micro_batch: int) -> float | None:
    """Validation perplexity of the engine's current weights. Collective."""
    if windows.shape[0] == 0:
        return None
    return ppl(*zero.window_nll(job, windows, micro_batch))


def train_step(engine, admm, comm, batches: GlobalBatches, step: int, cfg: ElsaConfig) -> float:
    """One global batch: set λ and lr, accumulate micro batches, step (ADMM runs inside). Returns the global mean loss.

    ``admm`` is the AdmmOptimizer, or the plain base optimizer for an ordinary fine-tuning step.
    """
    if hasattr(admm, "begin_step"):
        admm.begin_step(step)
    lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
    for group in admm.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros(2, dtype=torch.float64)
    inject_nan = os.environ.get(INJECT_NAN_ENV) == str(step)
    for ids in batches.micro_batches(step):
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        if inject_nan:  # fault injection for tests of the NaN path
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        loss_sum += torch.tensor([float(loss.detach()), 1.0], dtype=torch.float64)
    comm.all_reduce_sum(loss_sum)  # collective: the global mean loss of this step
    return float(loss_sum[0] / loss_sum[1])


@dataclass
class RunState:
    """Everything of the loop a checkpoint must bring back (the data position is ``next_step`` itself)."""

    next_step: int = 0
    lam: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    dense_ppl: float | None = None
    baseline_ppl: float | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)


def fingerprint(cfg: ElsaConfig, world: int) -> dict[str, Any]:
    """Settings a resumed run must share with the run that wrote the checkpoint."""
    keys = ("model", "dataset", "sparsity", "pattern", "sparsity_profile", "init_mask", "targets", "steps", "interval", "lmda",
            "lmda_schedule", "projection", "z_dtype", "u_dtype", "base_optimizer", "lr", "seqlen", "seed")
    settings = {k: v for k, v in cfg.model_dump(mode="json").items() if k in keys}
    if cfg.sparsity_profile:  # the ratios, not the path: an edited profile is a different run
        settings["sparsity_profile"] = load_profile(cfg.sparsity_profile)
    return {"world_size": world, **settings}


def train(job: zero.ZeroJob, cfg: ElsaConfig, batches: GlobalBatches, state: RunState, checkpoint=None) -> dict[str, Any]:
    """The ADMM loop from ``state.next_step``: one engine step per global batch; z, u update inside the step.

    ``checkpoint(state)`` is called (on every rank) every ``cfg.save_interval`` steps before the last.
    """
    from tqdm import tqdm

    admm = job.admm
    admm.lam = state.lam
    bar = tqdm(range(state.next_step, cfg.steps), desc="elsa", unit="step", disable=job.comm.rank != 0,
               dynamic_ncols=True, initial=state.next_step, total=cfg.steps)
    for step in bar:
        t0 = time.perf_counter()
        step_loss = train_step(job.engine, admm, job.comm, batches, step, cfg)
        state.step_times.append(time.perf_counter() - t0)
        if not math.isfinite(step_loss):
            raise ElsaError(f"the loss became {step_loss} at step {step}; the run stopped there (the last checkpoint, if any, "
                            f"is intact; resume with a lower --lr or --lmda)")
        state.losses.append(step_loss)
        if step % cfg.log_interval == 0:
            bar.set_postfix(loss=f"{step_loss:.4f}", lmda=f"{admm.lam:.3g}", lr=f"{admm.param_groups[0]['lr']:.2e}")
        if admm.projected_this_step:
            sums = job.comm.all_reduce_sum(admm.local_metrics())  # collective
            entry = {"step": step + 1, "loss": step_loss, **summarize_metrics(sums, admm.lam)}
            entry["final"] = step == cfg.steps - 1
            state.history.append(entry)
            if not entry["final"] and job.comm.rank == 0:
                bar.write(
                    f"[projection] step {step + 1}: loss {step_loss:.4f}  λ {entry['lambda']:.4g}  "
                    f"residual ‖x−z‖/‖x‖ {entry['residual']:.4f}  mask flips {entry['mask_flip_frac']:.4%}"
                )
        state.next_step, state.lam = step + 1, admm.lam
        if checkpoint is not None and cfg.save_interval and (step + 1) % cfg.save_interval == 0 and step + 1 < cfg.steps:
            checkpoint(state)
    losses = state.losses
    tail = losses[-min(len(losses), cfg.interval):]
    steady = state.step_times[1:] or state.step_times  # the first step builds lazy state (Adam, z, u)
    return {"history": state.history, "losses": losses, "final_loss": losses[-1], "final_loss_mean_last_interval": sum(tail) / len(tail),
            "step_time_s": sum(steady) / len(steady)}


def run(cfg: ElsaConfig, raw_ds: dict, output_dir: Path, overwrite: bool, ds_config_path: str | None = None,
        resume: bool = False) -> dict | None:
    """Prune ``cfg.model`` with ELSA under ZeRO-3 (or a one-shot method); returns the report on rank 0 (None elsewhere)."""
    if cfg.method is not Method.elsa:
        if resume:
            raise ElsaError(f"--resume continues an ELSA run; {cfg.method.value} has no checkpoints (it is one pass)")
        from elsa_ds.oneshot.job import run_oneshot

        return run_oneshot(cfg, output_dir, overwrite, ds_config_path)
    check_output_dir(output_dir, overwrite, resume)
    started = time.time()
    ds = zero.prepare_ds_config(raw_ds, cfg, int(os.environ.get("WORLD_SIZE", "1")))  # validate before any heavy work
    rank, world = zero.init_distributed()
    say = Printer(rank)
    say("[elsa_ds] resolved ELSA config:\n" + json.dumps(cfg.model_dump(mode="json"), indent=2))
    say("[elsa_ds] DeepSpeed config:\n" + json.dumps(ds, indent=2))

    tokenizer = load_tokenizer(cfg.model)
    global_batch, micro = ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]
    train_blocks = load_blocks(cfg.dataset, "train", tokenizer, cfg.seqlen, max_blocks=cfg.steps * global_batch)
    batches = GlobalBatches(train_blocks, global_batch, micro, world, rank, cfg.seed)
    val = load_blocks(cfg.dataset, "validation", tokenizer, cfg.seqlen, max_blocks=cfg.val_windows) if cfg.val_windows else torch.empty(0, cfg.seqlen, dtype=torch.long)
    say(f"[elsa_ds] data {cfg.dataset}: {train_blocks.shape[0]} train blocks x {cfg.seqlen} tokens, {val.shape[0]} validation windows; "
        f"global batch {global_batch} = {micro} micro x {world} ranks x {batches.grad_accum} accumulation")

    check_nvme_param_buffers(cfg.model, ds)
    init_masks = warm_start_masks(cfg, output_dir, tokenizer, rank, say) if cfg.init_mask and not resume else None
    torch.manual_seed(cfg.seed)
    loaded = zero.load_model(cfg.model, ds, cfg.gradient_checkpointing)
    pruned = select_targets(loaded.model, cfg.targets)
    targets = cfg.targets_for(zero.full_shapes(loaded.model, pruned))
    job = zero.build_engine(loaded, cfg, ds, pruned, targets, init_masks)
    n_pruned = sum(sl.numel for sg in job.layout for sl in sg.slices if sl.start == 0)
    goal = cfg.pattern if cfg.nm else f"{cfg.sparsity:.0%}" + (f" (profile {cfg.sparsity_profile})" if cfg.sparsity_profile else "")
    say(f"[elsa_ds] pruning {len(pruned)} layers ({n_pruned:,} weights) to {goal} with ELSA "
        f"(projection {cfg.projection.value}, λ {cfg.lmda} {cfg.lmda_schedule.value}, interval {cfg.interval}, {cfg.steps} steps"
        f"{', z warm-started from ' + cfg.init_mask if init_masks else ''})")

    ckpt_dir = output_dir / "checkpoints"
    if overwrite and rank == 0 and ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)  # a fresh run never mixes its checkpoints with an older run's
    state = RunState(fingerprint=fingerprint(cfg, world))
    if cfg.save_interval or resume:
        checkpoint.check_supported(ds)
    if resume:
        client = checkpoint.load_latest(job.engine, ckpt_dir, say, job.comm)
        if client is None:
            raise ElsaError(f"--resume: no loadable checkpoint in {ckpt_dir}; run without --resume to start over")
        changed = {k: (v, state.fingerprint.get(k)) for k, v in client["fingerprint"].items() if state.fingerprint.get(k) != v}
        if changed:
            raise ElsaError("--resume with changed settings is not supported (checkpoint vs now): "
                            + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in changed.items()))
        checkpoint.set_rng_state(client.pop("rng"))
        state = RunState(**client)
        say(f"[elsa_ds] continuing at step {state.next_step} of {cfg.steps}")
    else:
        state.dense_ppl = evaluate_windows(job, val, micro)
        if cfg.baseline == "magnitude" and val.shape[0] and zero.uses_nvme(ds):
            say("[elsa_ds] one-shot magnitude baseline skipped: it edits resident partitions, which NVMe offload swaps out")
        elif cfg.baseline == "magnitude" and val.shape[0]:
            with zero.magnitude_pruned_partitions(job, cfg.nm):
                state.baseline_ppl = evaluate_windows(job, val, micro)
        say(f"[elsa_ds] validation ppl: dense {state.dense_ppl}, one-shot magnitude {state.baseline_ppl}")

    def save(st: RunState) -> None:
        if rank == 0:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        tag = checkpoint.save(job.engine, ckpt_dir, st.next_step - 1, {**asdict(st), "rng": checkpoint.rng_state()},
                              cfg.keep_checkpoints, rank)
        say(f"[elsa_ds] checkpoint {ckpt_dir / tag}")

    trained = train(job, cfg, batches, state, save)
    dense_ppl, baseline_ppl = state.dense_ppl, state.baseline_ppl
    pruned_ppl = evaluate_windows(job, val, micro)

    staging = staging_dir(output_dir)
    if rank == 0:
        fresh_staging(output_dir)
        if init_masks is not None and init_masks.source == warm_start_path(output_dir):
            init_masks.source.unlink()  # read at the first step; a resumed run restores z from its checkpoint
    zero.export_model(job, tokenizer, staging)  # collective
    report = None
    if rank == 0:
        report = _report(cfg, ds, ds_config_path, world, job, targets, trained, staging, dense_ppl, baseline_ppl, pruned_ppl, val, started)
        write_json(staging / REPORT_NAME, report)
        publish(staging, output_dir, keep_checkpoints=bool(resume or cfg.save_interval))
        _print_summary(say, report, output_dir)
    torch.distributed.barrier()  # the last collective: the other ranks may leave now, rank 0 evaluates alone
    if rank == 0 and (cfg.eval_ppl or cfg.eval_tasks):
        del job, loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        from elsa_ds.evaluation.run import evaluate_output

        evaluate_output(output_dir, cfg.eval_ppl, cfg.eval_tasks, cfg.eval_include_path, cfg.seqlen)
    # a local teardown, no collective: without it gloo's threads could still be live when the interpreter
    # exits, and a rank then occasionally died in std::terminate after its work was done
    torch.distributed.destroy_process_group()
    return report


def warm_start_path(output_dir: Path) -> Path:
    """Where rank 0 leaves the one-shot masks of --init_mask for every rank (beside the output, so on the
    filesystem every node must share anyway)."""
    return staging_dir(output_dir).with_name(f".{output_dir.name}.init_mask.safetensors")


def warm_start_masks(cfg: ElsaConfig, output_dir: Path, tokenizer, rank: int, say: Printer) -> MaskReader:
    """Keep-masks for z₀: from a pruned model directory, or computed by a one-shot method on rank 0. Collective.

    The one-shot pass (SparseGPT on a 27B model takes hours) runs on rank 0 alone, before the ZeRO-3 model is
    built; the other ranks wait on a group with a long timeout and learn from rank 0 whether it succeeded.
    """
    if cfg.init_mask not in ONESHOT_METHODS:
        return MaskReader(cfg.init_mask)
    from elsa_ds.mask_file import write_masks
    from elsa_ds.oneshot.job import load_host_model, prune_oneshot

    path = warm_start_path(output_dir)
    waiting = torch.distributed.new_group(backend="gloo", timeout=timedelta(days=3))
    failure: BaseException | None = None
    if rank == 0:
        try:
            say(f"[elsa_ds] warm start: one-shot {cfg.init_mask} masks (other ranks wait)")
            done = prune_oneshot(cfg, cfg.init_mask, tokenizer, load_host_model(cfg.model), say)
            write_masks(path, done.masks)
            del done
        except BaseException as err:  # the other ranks must hear of it, whatever it is
            failure = err
    ok = torch.tensor([1.0 if rank == 0 and failure is None else 0.0])
    torch.distributed.broadcast(ok, src=0, group=waiting)
    if failure is not None:
        raise failure
    if not ok.item():
        raise ElsaError(f"rank 0 could not compute the --init_mask {cfg.init_mask} masks; its error says why")
    return MaskReader(path)


def _report(cfg, ds, ds_config_path, world, job, targets, trained, staging, dense_ppl, baseline_ppl, pruned_ppl, val, started) -> dict:
    """The report, with per-layer sparsity read back from the exported files (never from memory)."""
    expected = {sl.layer: sl.numel - sl.keep for sg in job.layout for sl in sg.slices}
    layers = verified_layers(staging, expected, targets, cfg.targets)
    last = trained["history"][-1] if trained["history"] else {}
    projections = [h for h in trained["history"] if not h["final"]]
    return {
        "model": cfg.model,
        "method": "elsa",
        "dataset": cfg.dataset,
        "sparsity": cfg.sparsity,
        "pattern": cfg.pattern,
        "sparsity_profile": cfg.sparsity_profile,
        "init_mask": cfg.init_mask,
        "steps": cfg.steps,
        "tokens": cfg.steps * ds["train_batch_size"] * cfg.seqlen,
        "world_size": world,
        "deepspeed_config": ds_config_path,
        "offload": {k: ds["zero_optimization"].get(k, {}).get("device", "none") for k in ("offload_param", "offload_optimizer")},
        "config": cfg.model_dump(mode="json"),
        "final_loss": trained["final_loss"],
        "step_time_s": trained["step_time_s"],
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "final_loss_mean_last_interval": trained["final_loss_mean_last_interval"],
        "lambda": last.get("lambda"),
        "residual": projections[-1]["residual"] if projections else None,
        "projections": trained["history"],
        "admm_state_bytes_per_param": last.get("admm_state_bytes_per_param"),
        "ppl": {"dense": dense_ppl, "magnitude_oneshot": baseline_ppl, "pruned": pruned_ppl,
                "windows": int(val.shape[0]), "seqlen": cfg.seqlen, "split": "validation", "protocol": PROTOCOL},
        "vs_magnitude": None if baseline_ppl is None or pruned_ppl is None else {
            "ppl_ratio": baseline_ppl / pruned_ppl, "ppl_reduction": baseline_ppl - pruned_ppl},
        "layers": layers,
        "overall_sparsity": layers_summary(layers),
        "wall_s": time.time() - started,
        "versions": versions(),
    }


def _print_summary(say: Printer, report: dict, output_dir: Path) -> None:
    p = report["ppl"]
    say(f"[elsa_ds] wrote {output_dir} ({len(report['layers'])} layers, each exactly at its target; overall sparsity {report['overall_sparsity']:.4f})")
    if p["dense"] is not None:
        say(f"[elsa_ds] validation perplexity over {p['windows']} windows of {p['seqlen']}: dense {p['dense']:.3f} | "
            f"one-shot magnitude {p['magnitude_oneshot'] if p['magnitude_oneshot'] is None else format(p['magnitude_oneshot'], '.3f')} | "
            f"ELSA {p['pruned']:.3f}")
    if report["vs_magnitude"]:
        say(f"[elsa_ds] ELSA perplexity is {report['vs_magnitude']['ppl_ratio']:.2f}x lower than one-shot magnitude pruning")
