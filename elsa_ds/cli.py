"""Argument parsing for the entry points; logic lives in the library, errors become one line and exit 2."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from elsa_ds.errors import ElsaError


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("DeepSpeed", "deepspeed", "transformers", "datasets"):
        logging.getLogger(name).setLevel(logging.WARNING)


def guarded(fn: Callable[[], int | None]) -> int:
    """Run ``fn``; an ElsaError becomes one line on stderr and exit code 2, with no traceback."""
    try:
        return fn() or 0
    except ElsaError as err:
        rank = os.environ.get("RANK", "0")
        print(f"elsa_ds: error: {err}" if rank == "0" else f"elsa_ds: error (rank {rank}): {err}", file=sys.stderr, flush=True)
        return 2


def prune_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elsa-prune",
        description="Prune a causal LM with ELSA (ADMM, objective-aware projection) under DeepSpeed ZeRO-3.",
    )
    p.add_argument("--deepspeed", required=True, metavar="CFG", help="DeepSpeed JSON (ZeRO-3); may hold an \"elsa\" block")
    p.add_argument("--output_dir", required=True, type=Path, help="where the pruned model and elsa_report.json go")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --output_dir")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUTPUT_DIR/checkpoints")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    g = p.add_argument_group("ELSA settings (override the JSON's \"elsa\" block; defaults in brackets)")
    g.add_argument("--method", choices=["elsa", "magnitude", "wanda", "sparsegpt"],
                   help="elsa, or a one-shot baseline run layer by layer in one process [elsa]")
    g.add_argument("--model", help="hub id or local directory [the embedded Shakespeare Gemma-2 demo]")
    g.add_argument("--dataset", help="c4 | wikitext2 | shakespeare | datasets name | local .txt/.jsonl/.parquet path [c4; demo: shakespeare]")
    g.add_argument("--sparsity", type=float, help="fraction of zeros per pruned layer, in [0, 1) [0.7]")
    g.add_argument("--pattern", metavar="N:M", help="unstructured, or N:M: at least N zeros in every M consecutive inputs; sets sparsity N/M [unstructured]")
    g.add_argument("--sparsity_profile", metavar="FILE", help="JSON {module-name regex: sparsity}: per-layer ratios, first match wins [none]")
    g.add_argument("--init_mask", metavar="METHOD_OR_DIR", help="warm-start ELSA's z from a magnitude|wanda|sparsegpt mask or a pruned model directory [none]")
    g.add_argument("--nsamples", type=int, help="calibration sequences for wanda/sparsegpt [128]")
    g.add_argument("--targets", metavar="REGEX", help="regex over module names of nn.Linear layers to prune [every Linear in the decoder layers]")
    g.add_argument("--steps", type=int, help="optimizer steps [4096; demo: 512]")
    g.add_argument("--interval", type=int, help="steps between projections [32]")
    g.add_argument("--lmda", type=float, help="ADMM penalty λ (peak for linear/cosine) [0.01]")
    g.add_argument("--lmda_schedule", choices=["constant", "linear", "cosine"], help="λ schedule [constant]")
    g.add_argument("--projection", choices=["fisher", "magnitude"], help="score F·(x+u)² or (x+u)² [fisher]")
    g.add_argument("--z_dtype", choices=["fp32", "bf16", "fp8"], help="storage of z [fp32]")
    g.add_argument("--u_dtype", choices=["fp32", "bf16", "fp8"], help="storage of u [fp32]")
    g.add_argument("--base_optimizer", choices=["auto", "adam", "cpu_adam", "adam8bit"], help="optimizer ADMM wraps [auto]")
    g.add_argument("--lr", type=float, help="peak learning rate, linear decay [2e-4; demo: 1e-3]")
    g.add_argument("--seqlen", type=int, help="tokens per block [2048; demo: 256]")
    g.add_argument("--micro_batch", type=int, help="blocks per rank per forward [train_micro_batch_size_per_gpu; demo: 4]")
    g.add_argument("--seed", type=int, help="seed of data order [0]")
    g.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute activations in backward [on; demo: off]")
    g.add_argument("--val_windows", type=int, help="validation windows for dense/pruned perplexity, 0 = skip [128; demo: 64]")
    g.add_argument("--save_interval", type=int, help="steps between checkpoints in OUTPUT_DIR/checkpoints, 0 = none [0]")
    g.add_argument("--keep_checkpoints", type=int, help="newest checkpoints kept [2]")
    g.add_argument("--nvme_path", metavar="DIR", help="NVMe offload directory (overrides the config's nvme_path)")
    g.add_argument("--baseline", choices=["magnitude", "none"], help="one-shot baseline evaluated on the same windows [magnitude]")
    e = p.add_argument_group("evaluation of the saved model at the end (the launch/evaluate.py protocol, rank 0 only)")
    e.add_argument("--eval_ppl", metavar="LIST", help="comma list of wikitext2 | c4 | local text paths [none]")
    e.add_argument("--eval_tasks", metavar="LIST", help="comma list of lm-eval tasks, 0-shot; 'paper' = the seven tasks [none]")
    e.add_argument("--eval_include_path", metavar="DIR", help="directory of local lm-eval task YAMLs")
    return p


ELSA_FLAGS = ("method", "model", "dataset", "sparsity", "pattern", "sparsity_profile", "init_mask", "nsamples", "targets", "steps", "interval", "lmda", "lmda_schedule", "projection",
              "z_dtype", "u_dtype", "base_optimizer", "lr", "seqlen", "micro_batch", "seed", "val_windows", "baseline", "nvme_path", "gradient_checkpointing",
              "save_interval", "keep_checkpoints", "eval_ppl", "eval_tasks", "eval_include_path")


def main_prune(argv: list[str] | None = None) -> int:
    args = prune_parser().parse_args(argv)
    _quiet_libraries()

    def go() -> None:
        from elsa_ds.config import read_ds_config, resolve_config
        from elsa_ds.output import check_output_dir
        from elsa_ds.prune import run

        raw = read_ds_config(args.deepspeed)
        cfg = resolve_config(raw, {k: getattr(args, k) for k in ELSA_FLAGS}, source=args.deepspeed)
        check_output_dir(args.output_dir, args.overwrite, args.resume)
        if cfg.eval_tasks:  # an unknown task must not wait for the end of a multi-day run to be found
            from elsa_ds.evaluation.zeroshot import expand_tasks, task_manager

            task_manager(expand_tasks(",".join(cfg.eval_tasks)), cfg.eval_include_path)
        run(cfg, raw, args.output_dir, args.overwrite, ds_config_path=args.deepspeed, resume=args.resume)

    return guarded(go)


def estimate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elsa-estimate", description="Estimate GPU, CPU and NVMe memory of an ELSA job from configs alone.")
    p.add_argument("--model", required=True, help="hub id (shipped configs resolve offline), model directory or config.json")
    p.add_argument("--deepspeed", required=True, metavar="CFG", help="DeepSpeed JSON (its \"elsa\" block sets state dtypes and optimizer)")
    p.add_argument("--num_gpus", type=int, default=1, help="GPUs (ranks) per node [1]")
    p.add_argument("--num_nodes", type=int, default=1, help="nodes [1]")
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per GPU per forward [the JSON's]")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per sequence [2048]")
    p.add_argument("--targets", default=None, help="regex of pruned modules [decoder-layer Linears]")
    p.add_argument("--no_gradient_checkpointing", action="store_true", help="estimate activations without checkpointing")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p


def main_estimate(argv: list[str] | None = None) -> int:
    args = estimate_parser().parse_args(argv)
    _quiet_libraries()

    def go() -> None:
        import json

        from elsa_ds.config import read_ds_config
        from elsa_ds.memory import estimate, model_shape, resolve_model_config

        if args.num_gpus <= 0 or args.num_nodes <= 0:
            raise ElsaError("--num_gpus and --num_nodes must be positive")
        ds = read_ds_config(args.deepspeed)
        shape = model_shape(resolve_model_config(args.model), args.targets)
        est = estimate(shape, ds, args.num_gpus, args.num_nodes, args.micro_batch, args.seqlen,
                       gradient_checkpointing=not args.no_gradient_checkpointing)
        gib = 2 ** 30
        print(f"{args.model}: {est.num_params / 1e9:.2f} B parameters ({est.pruned_params / 1e9:.2f} B pruned), "
              f"{args.num_nodes} node(s) x {args.num_gpus} GPU(s), {args.deepspeed}")
        print(f"{'':12s} {'per GPU':>12s} {'CPU per node':>14s} {'NVMe':>12s}")
        for name, row in est.breakdown.items():
            print(f"{name:12s} {row['per_gpu'] / gib:10.2f} GiB {row['per_node_cpu'] / gib:12.2f} GiB {row['nvme'] / gib:10.2f} GiB")
        print(f"{'total':12s} {est.per_gpu_bytes / gib:10.2f} GiB {est.per_node_cpu_bytes / gib:12.2f} GiB {est.nvme_bytes / gib:10.2f} GiB")
        if args.json:
            print(est.to_json())

    return guarded(go)


def evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elsa-evaluate",
        description="Evaluate a (pruned) causal LM with the pruning papers' protocol: sparsity, perplexity, zero-shot accuracy.",
    )
    p.add_argument("--model", metavar="ID_OR_DIR", help="hub id or saved model directory (required unless --compare)")
    p.add_argument("--ppl", default="", metavar="LIST",
                   help="comma list of wikitext2 | c4 | local .txt/.jsonl/.parquet path or directory [none]")
    p.add_argument("--tasks", nargs="?", const="paper", default=None, metavar="LIST",
                   help="comma list of lm-eval tasks, 0-shot; 'paper' or no value: boolq,rte,hellaswag,winogrande,"
                        "arc_easy,arc_challenge,openbookqa [none]")
    p.add_argument("--include_path", metavar="DIR", help="directory of local lm-eval task YAMLs")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per perplexity window [2048]")
    p.add_argument("--batch_size", type=int, default=1, help="windows / lm-eval requests per forward [1]")
    p.add_argument("--limit", type=int, default=None, help="examples per task and most windows per dataset; quick checks only [all]")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="weights' dtype [bf16 on CUDA, fp32 on CPU]")
    p.add_argument("--device_map", choices=["auto"], default=None,
                   help="spread a model too large for one GPU over GPUs, CPU and disk (CUDA only) [one device]")
    p.add_argument("--offload_folder", metavar="DIR",
                   help="parent of the temporary disk-offload directory for --device_map auto [system temp]")
    p.add_argument("--output", type=Path, metavar="FILE.json", help="write the result JSON here")
    p.add_argument("--markdown", type=Path, metavar="FILE.md", help="write the markdown table here")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="render result JSONs of several models as one markdown table, evaluate nothing")
    return p


def main_evaluate(argv: list[str] | None = None) -> int:
    parser = evaluate_parser()
    args = parser.parse_args(argv)
    if args.compare and (args.model or args.ppl or args.tasks):
        parser.error("--compare renders existing results; drop --model/--ppl/--tasks")
    if not args.compare and not args.model:
        parser.error("--model is required (or --compare A.json B.json ...)")
    _quiet_libraries()
    logging.getLogger("lm_eval").setLevel(logging.WARNING)

    def go() -> None:
        if args.compare:
            from elsa_ds.evaluation.tables import compare, write_atomic

            table = compare(args.compare)
            print(table, end="", flush=True)
            if args.markdown is not None:
                write_atomic(args.markdown, table)
            return
        from elsa_ds.evaluation.run import EvalSettings, run
        from elsa_ds.evaluation.zeroshot import expand_tasks

        run(EvalSettings(
            model=args.model, ppl=[s for s in (x.strip() for x in args.ppl.split(",")) if s],
            tasks=expand_tasks(args.tasks) if args.tasks is not None else [], include_path=args.include_path,
            seqlen=args.seqlen, batch_size=args.batch_size, limit=args.limit, dtype=args.dtype, device_map=args.device_map,
            offload_folder=args.offload_folder, output=args.output, markdown=args.markdown,
        ))

    return guarded(go)
