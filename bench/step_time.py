"""elsa-estimate's time per step against real runs, and its answer for the paper's 27B budget.

    python bench/step_time.py                       # the demo job (2 ranks) under zero3_offload and ELSA-L, measured
    python bench/step_time.py --configs ds_configs/zero3.json ds_configs/zero3_nvme.json --steps 16 --json
    python bench/step_time.py --plan                # no run: Gemma-2/3-27B, 4096 steps of 8 x 2048 tokens per GPU
    python bench/step_time.py --layers 4 --ranks 1 --steps 8 --json   # on a GPU host: issue 43's 27B-shaped jobs

A run is ``launch/ablate_offload.py``'s (``elsa_ds.capacity.ablation.run_ablation``): the README's main job on the embedded demo
model (its profile: seqlen 256, micro batch 4) for ``--steps`` steps, projection every ``--interval``, no validation, no
one-shot start, under each config; the rates are measured on this machine first (``step_time.measure``), and every row
puts the job's mean step time (its report's, the first step left out) beside the estimate. The report's mean holds
the projections that fall in steps 1 .. steps-1 where the estimate amortizes one per interval: the row compares the
estimate counted as the report counts (``StepTime.report_mean``); beside it, from the same runs, the peak host RSS of
the job's process tree and the GPU allocator's peak against elsa-estimate's host and GPU figures. On a GPU host the
same command measures the GPU path (the rates then include the pinned copies and the GPU's matmul). ``--layers N``
runs issue 43's jobs instead of the demo: Gemma-2-27B's shapes cut to N decoder layers (``bench/scale.py``'s model),
--random_init --freeze_embeddings, Shakespeare, seqlen 2048, micro batch 1, a batch of one sequence per rank, 90 %.

``--plan`` prints, from typical rates alone (``--machine``), memory per rank and node and the time of the mission's run:
Gemma-2-27B and Gemma-3-27B, 4096 steps of 8 x 2048 tokens per GPU (micro batch 1), on one 8-GPU node and on two, for
each shipped offload config; and the lent H200's 4-layer jobs of issue 43 (8 steps, interval 4) with what they measured.
With --json the last line is one JSON object: the rows.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import build_model_dir  # noqa: E402  (Gemma-2-27B's config cut to N layers)
from elsa_ds.step_profile import PROFILE_OUT_ENV, PROFILE_STEPS_ENV, parse_window, read_profile  # noqa: E402

CONFIGS = ["ds_configs/zero3_offload.json", "ds_configs/zero3_offload_elsal.json"]
# the budget's configs: a shipped JSON and the settings it runs with; ELSA-L's states with everything on 80 GB GPUs
PLAN_CONFIGS = {"zero3_offload": ("zero3_offload", {}), "zero3_offload_elsal": ("zero3_offload_elsal", {}),
                "zero3_nvme": ("zero3_nvme", {}),
                "zero3 + ELSA-L's states": ("zero3", {"base_optimizer": "adam8bit", "z_dtype": "fp8", "u_dtype": "bf16"})}
PLAN_MODELS = ("google/gemma-2-27b", "google/gemma-3-27b-pt")
# issue 43's runs on the lent H200 (16-core host; Gemma-2-27B cut to 4 layers, --random_init --freeze_embeddings,
# seqlen 2048, batch 1, 8 steps, interval 4, 90 %): the report's step_time_s, as the issue records them
H200_RUNS = {"zero3_offload": 2.14, "zero3_offload_elsal": 1.69}


def measured_rows(args) -> list[dict]:
    from elsa_ds.capacity.ablation import run_ablation

    out = args.out or Path(tempfile.mkdtemp(prefix="elsa_bench_step_time_"))
    prune_args = ["--steps", str(args.steps), "--interval", str(args.interval), "--val_windows", "0", "--baseline", "none",
                  "--init_mask", "none"]
    if args.layers:
        model = build_model_dir(out / "model", args.layers)
        prune_args += ["--model", str(model), "--random_init", "--freeze_embeddings", "--dataset", "shakespeare",
                       "--seqlen", "2048", "--micro_batch", "1", "--batch_size", str(args.ranks), "--sparsity", "0.9"]
    prune_args += [a for a in args.prune_args if a != "--"]
    rows = []
    profile = (lambda name: out / f"{name}.profile.json") if args.profile else None
    run_env = (lambda name: {PROFILE_STEPS_ENV: args.profile, PROFILE_OUT_ENV: str(profile(name))}) if profile else None
    for row in run_ablation(args.configs, out, args.ranks, prune_args, run_env):
        estimate = row.est_step_time_s
        rows.append({"config": row.config, "ranks": args.ranks, "steps": args.steps, "interval": args.interval,
                     "measured_s": row.step_time_s, "estimated_s": estimate, "ratio": estimate / row.step_time_s,
                     "within_25pct": abs(estimate / row.step_time_s - 1) <= 0.25,
                     "timed_micro_step_s": row.est_micro_step_s,  # the estimate's micro-step timed here, or None
                     # its optimizer's step and one projection timed here, in DeepSpeedCPUAdam steps, or None
                     "timed_optimizer_step": row.est_optimizer_step, "timed_projection": row.est_projection,
                     # issue 43's memory check from the same runs: the process tree's peak host RSS and the GPU's
                     # allocator peak (report) against elsa-estimate's per-node host and per-GPU figures
                     "host_peak_bytes": row.peak_host_rss_bytes, "host_est_bytes": row.est_host_bytes,
                     "host_ratio": row.est_host_bytes / row.peak_host_rss_bytes if row.peak_host_rss_bytes else None,
                     "gpu_peak_bytes": row.peak_gpu_bytes, "gpu_est_bytes": row.est_gpu_bytes,
                     "nvme_peak_bytes": row.nvme_peak_bytes, "nvme_est_bytes": row.est_nvme_bytes})
        if profile:  # where its step's time went: forward, backward, step (--profile)
            rows[-1] |= read_profile(profile(row.config))
    return rows


def _timing(model: str, config: str, num_gpus: int, num_nodes: int, machine: str, settings: dict):
    """(memory, time) of the job as ``elsa-estimate --json`` gives them: the entry point itself, the settings as flags."""
    from elsa_ds.capacity.step_time import StepTime
    from elsa_ds.cli import main_estimate

    argv = ["--model", model, "--deepspeed", config, "--num_gpus", str(num_gpus), "--num_nodes", str(num_nodes),
            "--machine", machine, "--log_level", "warning", "--json"]
    for name, value in settings.items():
        argv += [f"--{name}"] if value is True else [f"--no_{name}"] if value is False else [f"--{name}", str(value)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if main_estimate(argv) != 0:
            raise SystemExit(f"elsa-estimate {' '.join(argv)} failed (its error is above)")
    est = json.loads(printed.getvalue().strip().splitlines()[-1])
    return est, StepTime(**est.pop("time"))


def plan_rows(machine: str) -> list[dict]:
    gib = 2**30
    rows = []
    for model in PLAN_MODELS:
        for config, (json_name, states) in PLAN_CONFIGS.items():
            for nodes in (1, 2):
                settings = {"seqlen": 2048, "micro_batch": 1, "batch_size": 8 * 8 * nodes, "steps": 4096, **states}
                est, t = _timing(model, json_name, 8, nodes, machine, settings)
                rows.append({"model": model, "config": config, "nodes": nodes, "gpus_per_node": 8, "machine": machine,
                             "per_gpu_gib": est["per_gpu_bytes"] / gib, "cpu_per_node_gib": est["per_node_cpu_bytes"] / gib,
                             "nvme_gib": est["nvme_bytes"] / gib, "step_s": t.step_s, "run_h": t.run_s / 3600,
                             "tokens": 4096 * 8 * 8 * nodes * 2048, "components": t.components})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp) / "model", 4)
        for config, measured in H200_RUNS.items():
            settings = {"seqlen": 2048, "micro_batch": 1, "batch_size": 1, "steps": 8, "interval": 4, "sparsity": 0.9,
                        "freeze_embeddings": True, "init_mask": "none", "val_windows": 0}
            est, t = _timing(str(model_dir), config, 1, 1, "gpu-vm-16c", settings)
            estimate = t.report_mean()
            rows.append({"model": "gemma-2-27b, 4 layers", "config": config, "nodes": 1, "gpus_per_node": 1,
                         "machine": "gpu-vm-16c", "cpu_per_node_gib": est["per_node_cpu_bytes"] / gib, "step_s": estimate,
                         "measured_step_s": measured, "ratio": estimate / measured, "components": t.components})
    return rows


# the lent GPU machine (bench/results/device_check_2026-11-27_h200.json): host memory, GPU memory (H200; an H100 has 79.2),
# and its 64 GiB disk less the checkout, the wheels and the ship's payload (~10 GiB) for NVMe files and the export
LENT_HOST_GIB, LENT_GPU_GIB, LENT_DISK_GIB = 125.9, 139.8, 54.0
FIT_CONFIGS = ("zero3", "zero3_offload", "zero3_offload_elsal", "zero3_nvme")


def fit_rows() -> list[dict]:
    """The most Gemma-2-27B-shaped decoder layers each config can prune on the lent machine by the estimate (host, GPU
    and NVMe all within the machine), embeddings frozen and trained, seqlen 2048, batch 1, and the time of a step there."""
    gib = 2**30
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in FIT_CONFIGS:
            for frozen in (True, False):
                best = None
                for layers in range(1, 47):
                    settings = {"seqlen": 2048, "micro_batch": 1, "batch_size": 1, "steps": 4096, "sparsity": 0.9,
                                "freeze_embeddings": frozen, "init_mask": "none"}
                    est, t = _timing(str(build_model_dir(Path(tmp) / f"m{layers}", layers)), f"ds_configs/{config}.json",
                                     1, 1, "gpu-vm-16c", settings)
                    if (est["per_node_cpu_bytes"] > LENT_HOST_GIB * gib or est["per_gpu_bytes"] > LENT_GPU_GIB * gib
                            or est["nvme_bytes"] > LENT_DISK_GIB * gib):
                        break
                    best = {"config": config, "freeze_embeddings": frozen, "layers": layers, "params_b": est["num_params"] / 1e9,
                            "cpu_gib": est["per_node_cpu_bytes"] / gib, "gpu_gib": est["per_gpu_bytes"] / gib,
                            "nvme_gib": est["nvme_bytes"] / gib, "step_s": t.step_s}
                rows.append(best or {"config": config, "freeze_embeddings": frozen, "layers": 0})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--interval", type=int, default=4)
    ap.add_argument("--layers", type=int, default=0, help="Gemma-2-27B's shapes cut to this many layers [0: the demo]")
    ap.add_argument("--out", type=Path, default=None, help="runs and logs [a temporary directory]")
    ap.add_argument("--plan", action="store_true", help="no run: the 27B budget's estimates and issue 43's H200 jobs")
    ap.add_argument("--machine", default="gpu-server", help="typical rates for --plan's 8-GPU nodes [gpu-server]")
    ap.add_argument("--profile", default="", help="FIRST:COUNT: each run profiles COUNT steps from FIRST (torch.profiler, "
                    "then COUNT more under cProfile; elsa_ds/step_profile.py), its row's 'profile' [none]")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("prune_args", nargs=argparse.REMAINDER, help="-- then more flags for launch/prune.py")
    args = ap.parse_args()
    try:
        parse_window(args.profile)
    except ValueError as err:
        ap.error(str(err))
    if args.plan:
        rows = plan_rows(args.machine)
        fits = fit_rows()
        print("| model | config | nodes x GPUs | per GPU GiB | CPU per node GiB | NVMe GiB | s/step | run h | measured s/step |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['model']} | {r['config']} | {r['nodes']} x {r['gpus_per_node']} | {r.get('per_gpu_gib', float('nan')):.1f} | "
                  f"{r['cpu_per_node_gib']:.0f} | {r.get('nvme_gib', 0):.0f} | {r['step_s']:.2f} | "
                  f"{r.get('run_h', float('nan')):.1f} | {r.get('measured_step_s', '')} |")
        print(f"\nOn the lent machine ({LENT_HOST_GIB} GiB host, {LENT_GPU_GIB} GiB GPU, {LENT_DISK_GIB} GiB disk free), "
              "Gemma-2-27B's layers, seqlen 2048, batch 1:")
        print("| config | embeddings | layers | B params | CPU GiB | GPU GiB | NVMe GiB | s/step |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in fits:
            print(f"| {r['config']} | {'frozen' if r['freeze_embeddings'] else 'trained'} | {r['layers']} | "
                  f"{r.get('params_b', 0):.2f} | {r.get('cpu_gib', 0):.1f} | {r.get('gpu_gib', 0):.1f} | "
                  f"{r.get('nvme_gib', 0):.1f} | {r.get('step_s', 0):.2f} |")
        rows = rows + [{"fits_lent_machine": r} for r in fits]
    else:
        rows = measured_rows(args)
        gib = lambda b: "—" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
        print("| config | ranks | steps | measured s/step | estimated | est / measured | host peak GiB | est | est / peak |"
              " GPU peak GiB | est |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            host = "—" if r["host_ratio"] is None else f"{r['host_ratio']:.2f}"
            print(f"| {r['config']} | {r['ranks']} | {r['steps']} | {r['measured_s']:.3f} | {r['estimated_s']:.3f} | {r['ratio']:.2f} "
                  f"| {gib(r['host_peak_bytes'])} | {gib(r['host_est_bytes'])} | {host} | {gib(r['gpu_peak_bytes'])} "
                  f"| {gib(r['gpu_est_bytes'])} |")
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
