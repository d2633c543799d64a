"""Quality benchmark: dense, dense fine-tuned, one-shot, one-shot + fine-tuning, one-shot + LoRA and ELSA at every
sparsity on the same model, data and token budget, judged by the same held-out evaluation.

    python bench/quality.py                                           # the shipped demo model, every row, 50-99 %
    python bench/quality.py --quick                                   # dense, dense+ft, sparsegpt, wanda+ft, elsa at 70/90 %
    python bench/quality.py --model ~/.cache/elsa_ds/models/docs-llama \\
        --dataset ~/.cache/elsa_ds/corpora/linux-doc/prune.jsonl \\
        --eval_ppl ~/.cache/elsa_ds/corpora/linux-doc/test.jsonl --seqlen 256 --steps 400 --out out/q-docs

Every pruned or trained model is made by ``launch/prune.py`` (training rows under the deepspeed launcher with
--num_gpus ranks; one-shot rows in one process), all from the same training / calibration text; its perplexity on
--eval_ppl (the TEST split: text no run trained or tuned on) is measured by ``elsa_ds.evaluation`` (the code behind
``launch/evaluate.py``). Training rows (ELSA, ``+ft``, ``+lora``, ``dense+ft``) share one budget: --steps global
batches of the DeepSpeed JSON's train_batch_size x --seqlen tokens; their lr, λ and λ schedule come from the
defaults rule (``elsa_ds/settings/defaults.py``) unless --elsa_args / --ft_args set them. Finished runs are reused with --reuse.

Writes OUT/quality.md (table, every row's budget, the targets), OUT/quality.png (perplexity vs sparsity, log scale)
and OUT/quality.json (also to --json FILE).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from quality_report import checks, plot, table  # noqa: E402

from elsa_ds.zero.dist import free_port  # noqa: E402 - the launcher's rendezvous: two benches at once must not both take 29500

ONESHOT = ("magnitude", "wanda", "sparsegpt")
# row name -> (--method, --finetune); "dense" is the model itself, evaluated
ROWS = {"dense": (None, None), "dense+ft": ("dense", "full"),
        **{m: (m, None) for m in ONESHOT}, **{f"{m}+ft": (m, "full") for m in ONESHOT},
        **{f"{m}+lora": (m, "lora") for m in ONESHOT}, "elsa": ("elsa", None)}
DEFAULT_ROWS = ("dense", "dense+ft", "magnitude", "wanda", "sparsegpt", "wanda+ft", "sparsegpt+ft", "wanda+lora", "elsa")
QUICK_ROWS = ("dense", "dense+ft", "sparsegpt", "wanda+ft", "elsa")
SPARSITIES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)


def trains(row: str) -> bool:
    return row == "elsa" or "+" in row


def prune_command(method: str, finetune: str | None, sparsity: float | None, out: Path, *, deepspeed: str,
                  steps: int | None = None, num_gpus: int = 1, model: str | None = None, dataset: str | None = None,
                  seqlen: int | None = None, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``launch/prune.py``'s command for one run, without validation or a baseline evaluation (the bench evaluates on
    its own): a run that trains (``steps`` given) under the deepspeed launcher with ``num_gpus`` ranks, a one-shot one
    in one process. :func:`with_port` gives the launcher a free rendezvous port. bench/device/curve.py builds its cells'
    commands here too."""
    cmd = [str(ROOT / "launch" / "prune.py"), "--deepspeed", deepspeed, "--method", method, "--output_dir", str(out),
           "--overwrite", "--val_windows", "0"]
    cmd += ["--baseline", "none"] if method == "elsa" else []  # ELSA's comparison; another method reads no --baseline
    cmd += ["--sparsity", str(sparsity)] if sparsity is not None else []
    cmd += ["--finetune", finetune] if finetune else []
    cmd += ["--steps", str(steps)] if steps is not None else []
    cmd += [f for flag, value in (("--model", model), ("--dataset", dataset), ("--seqlen", seqlen))
            if value is not None for f in (flag, str(value))]
    cmd += list(extra)
    if steps is None:
        return [sys.executable, *cmd]
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed") or "deepspeed"
    return [launcher, "--num_gpus", str(num_gpus), *cmd]


def with_port(cmd: list[str]) -> list[str]:
    """A launcher command with a free ``--master_port`` (two at once must not both take 29500); others unchanged."""
    return cmd[:1] + ["--master_port", str(free_port())] + cmd[1:] if cmd[0] != sys.executable else cmd


def prune(row: str, sparsity: float | None, args, out: Path, extra: list[str]) -> dict:
    """One run through the real entry point (reused with --reuse when the same command finished before)."""
    method, finetune = ROWS[row]
    cmd = prune_command(method, finetune, sparsity, out, deepspeed=args.deepspeed, steps=args.steps if trains(row) else None,
                        num_gpus=args.num_gpus, model=args.model, dataset=args.dataset, seqlen=args.seqlen, extra=extra)
    stamp = out.with_name(out.name + "_cmd.json")
    if args.reuse and (out / "elsa_report.json").is_file() and stamp.is_file() and json.loads(stamp.read_text()) == cmd[1:]:
        return json.loads((out / "elsa_report.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    started = time.time()
    with log.open("w") as fh:
        rc = subprocess.run(with_port(cmd), cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,  # the port: not in the stamp
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if rc != 0:
        raise SystemExit(f"{row} at {sparsity}: launch/prune.py failed with exit code {rc}; see {log}")
    report = json.loads((out / "elsa_report.json").read_text())
    report["bench_wall_s"] = time.time() - started
    (out / "elsa_report.json").write_text(json.dumps(report, indent=2))
    stamp.write_text(json.dumps(cmd[1:]))
    return report


def heldout_ppl(model: str, source: str, seqlen: int, out: Path, limit: int | None, reuse: bool) -> float:
    """Perplexity of a saved model on ``source`` by the evaluation entry point's code (cached in ``out`` with --reuse)."""
    from elsa_ds.jobs.evaluate import EvalSettings, run

    if reuse and out.is_file():
        saved = json.loads(out.read_text())
        if saved["settings"]["limit"] == limit and source in saved["ppl"]:
            return saved["ppl"][source]["ppl"]
    result = run(EvalSettings(model=model, ppl=[source], seqlen=seqlen, batch_size=8, limit=limit, output=out,
                              overwrite=True))  # --reuse decides about an existing result
    return result["ppl"][source]["ppl"]


def budget(report: dict, row: str) -> str:
    if trains(row):
        seqlen = report["config"]["seqlen"]
        batch = report["tokens"] // max(report["steps"] * seqlen, 1)
        return f"{report['steps']} steps x {batch} x {seqlen} = {report['tokens']:,} tokens"
    return f"{report['tokens']:,} calibration tokens" if report.get("tokens") else "no data"


def settings_used(report: dict) -> str:
    c = report["config"]
    auto = (report.get("defaults") or {}).get("applied", {})
    if report["method"] == "elsa":
        text = f"lr {c['lr']:.3g}, λ {c['lmda']:g} {c['lmda_schedule']}, interval {c['interval']}"
    elif report.get("finetune"):
        text = f"lr {c['lr']:.3g}" + (f", LoRA r {c['lora_rank']} α {c['lora_alpha']:g}" if report["finetune"] == "lora" else "")
    else:
        return ""
    text += f", warm-up {c.get('warmup_steps', 0)}"
    if report["method"] == "elsa" and c.get("init_mask"):
        text += f", from {c['init_mask']}'s {'pruned model' if c.get('init_weights') else 'mask'}"
    return text + ("; from the defaults rule" if auto else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="hub id or directory [the embedded demo]")
    ap.add_argument("--dataset", default=None, help="training / calibration text [the demo's shakespeare; else c4]")
    ap.add_argument("--eval_ppl", default=None, help="held-out perplexity source, the TEST split [the dataset's validation split]")
    ap.add_argument("--seqlen", type=int, default=None, help="tokens per sequence for training and evaluation [demo 256; else 2048]")
    ap.add_argument("--steps", type=int, default=400, help="the training rows' budget in global batches [400]")
    ap.add_argument("--sparsities", type=float, nargs="+", default=None, help=f"[{' '.join(map(str, SPARSITIES))}; --quick: 0.7 0.9]")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=None, help=f"[{' '.join(DEFAULT_ROWS)}]")
    ap.add_argument("--quick", action="store_true", help=f"rows {' '.join(QUICK_ROWS)} at 70 and 90 %%")
    ap.add_argument("--limit", type=int, default=None, help="at most this many evaluation windows [all]")
    ap.add_argument("--deepspeed", default="ds_configs/zero3_offload.json")
    ap.add_argument("--num_gpus", type=int, default=1, help="ranks of the training runs [1]")
    ap.add_argument("--elsa_args", default="", help="extra flags for the ELSA runs, one string")
    ap.add_argument("--ft_args", default="", help="extra flags for the +ft / +lora / dense+ft runs, one string")
    ap.add_argument("--reuse", action="store_true", help="reuse finished runs and evaluations of the same command in --out")
    ap.add_argument("--out", type=Path, default=Path("out/quality"))
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    rows = args.rows or list(QUICK_ROWS if args.quick else DEFAULT_ROWS)
    sparsities = args.sparsities or ([0.7, 0.9] if args.quick else list(SPARSITIES))

    from elsa_ds.files.io import write_json
    from elsa_ds.log import setup_logging
    from elsa_ds.settings.config import DEMO_MODEL_DIR, resolve_config
    from elsa_ds.zero.ds_config import DsConfig

    setup_logging()
    model = args.model or str(DEMO_MODEL_DIR)
    cfg = resolve_config(DsConfig.load(args.deepspeed).raw, {"model": model, "dataset": args.dataset, "seqlen": args.seqlen})
    source = args.eval_ppl or cfg.dataset
    args.out.mkdir(parents=True, exist_ok=True)
    results = []

    def record(row: str, sparsity: float | None, path: str, report: dict | None) -> None:
        ppl = heldout_ppl(path, source, cfg.seqlen, args.out / "runs" / f"{Path(path).name}_eval.json", args.limit, args.reuse) \
            if report else heldout_ppl(path, source, cfg.seqlen, args.out / "dense_eval.json", args.limit, args.reuse)
        entry = {"row": row, "sparsity": sparsity, "ppl": ppl, "budget": budget(report, row) if report else "none",
                 "settings": settings_used(report) if report else "", "wall_s": report.get("bench_wall_s") if report else None,
                 "tokens": report.get("tokens") if report else 0, "overall_sparsity": report["overall_sparsity"] if report else 0.0}
        results.append(entry)
        print(f"[quality] {row:15s} {'' if sparsity is None else f'{sparsity:.0%}':>4s}: ppl {ppl:10.3f}  ({entry['budget']}; "
              f"{entry['settings']})", flush=True)

    extra = {"elsa": shlex.split(args.elsa_args), "ft": shlex.split(args.ft_args)}
    for row in (r for r in rows if ROWS[r][0] in (None, "dense")):  # sparsity-independent: once
        if row == "dense":
            record(row, None, model, None)
        else:
            out = args.out / "runs" / row.replace("+", "_")
            record(row, None, str(out), prune(row, None, args, out, extra["ft"]))
    for s in sparsities:
        for row in (r for r in rows if ROWS[r][0] not in (None, "dense")):
            out = args.out / "runs" / f"{row.replace('+', '_')}_{round(100 * s)}"
            report = prune(row, s, args, out, extra["elsa"] if row == "elsa" else extra["ft"] if trains(row) else [])
            record(row, s, str(out), report)

    md = table(results, rows, sparsities, source, args.limit) + checks(results)
    (args.out / "quality.md").write_text(md)
    plot(results, rows, args.out / "quality.png")
    payload = {"model": model, "eval": source, "seqlen": cfg.seqlen, "steps": args.steps, "limit": args.limit,
               "deepspeed": args.deepspeed, "elsa_args": args.elsa_args, "ft_args": args.ft_args, "results": results}
    for path in filter(None, (args.out / "quality.json", args.json)):
        write_json(path, payload)
    print(md)
    print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
