"""ELSA at Gemma-2-27B's real shapes on a machine whose RAM cannot hold the training state: ZeRO-3 + NVMe offload,
memory per phase measured against the estimator.

    python bench/scale.py                                        # default N, 1 rank, ds_configs/zero3_nvme.json
    python bench/scale.py --layers 1 --ranks 1 --nvme_path /mnt/nvme --json
    python bench/scale.py --train_embeddings                     # the embedding trained too: refused up front here

The model is the shipped ``google/gemma-2-27b`` config (hidden 4608, MLP 36864, 32 heads / 16 KV heads, head_dim 128,
vocabulary 256000, query_pre_attn_scalar 144, sliding window, soft-capping) cut to N decoder layers and built with
``--random_init`` straight into ZeRO-3 partitions: no rank ever holds the whole model. Default N: the smallest for
which parameters + gradients + fp32 masters + Adam moments + z/u of the trained tensors (the frozen embedding counts
its 16-bit parameters only) exceed 1.5x this machine's RAM. Tokens come from the demo's 4096-entry tokenizer and the
``shakespeare`` corpus (ids < 256000; the embedding keeps all 256000 rows).

The job is the real recipe: ``launch/prune.py`` under the deepspeed launcher, a few steps (the first, a projection,
a plain step, the final projection), then the streamed consolidated export and its verification (exact per-layer
sparsity read back from the files). The DeepSpeed config is ``--deepspeed`` with its NVMe buffers fitted to the model
(written beside the run and printed): the parameter swapper's buffers hold the largest partition (the embedding's),
so only ``--param_buffers`` of them; six optimizer buffers (master, two moments, z, u, gradient) of the largest
sub-group, kept to one MLP weight's share by ``--sub_group_size``; ``max_in_cpu`` 0 so that parameters really live on
NVMe; ``stage3_max_reuse_distance`` 0 so that a gathered parameter is released after use.

A sampler records the process tree's RSS, the NVMe folder's size and the disk's free space every 0.25 s; the job's
phase markers (``ELSA_DS_PHASE_LOG``, ``elsa_ds/jobs/phases.py``) cut the series into phases: load, first step,
projection, step, final projection, export, verify. Beside each: the estimator's prediction for that phase.
Prints a table, writes it to ``--markdown`` (default ``bench/results/scale.md``), and with ``--json`` a JSON line last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30
BASE_MODEL = "google/gemma-2-27b"
STEPS, INTERVAL = 4, 2      # first step, projection, plain step, final projection
PHASE_ORDER = ("load", "first step", "projection", "step", "final projection", "validation", "export", "verify")


def machine_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


def build_model_dir(out: Path, layers: int) -> Path:
    """config.json of Gemma-2-27B with ``layers`` decoder layers, and the demo's tokenizer (no weights: --random_init)."""
    from elsa_ds.settings.config import DEMO_MODEL_DIR

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config(layers), indent=2) + "\n")
    for f in DEMO_MODEL_DIR.glob("tokenizer*.json"):
        shutil.copy(f, out / f.name)
    return out


def fitted_config(base: str, largest_partition: int, ranks: int, param_buffers: int, sub_group_size: float, nvme: Path) -> dict:
    """``base`` with NVMe buffers sized for this model (see the module docstring)."""
    from elsa_ds.zero.ds_config import NVME_OPTIMIZER_BUFFERS, DsConfig

    ds = DsConfig.load(base).raw
    zero = ds["zero_optimization"]
    align = 512  # DeepSpeed aligns swap buffers to 1024 bytes per aio thread: 512 16-bit elements
    if zero.get("offload_param", {}).get("device") == "nvme":
        zero["offload_param"].update(buffer_count=param_buffers, buffer_size=-(-largest_partition // align) * align, max_in_cpu=0,
                                     nvme_path=str(nvme))
    if zero.get("offload_optimizer", {}).get("device") == "nvme":
        zero["offload_optimizer"].update(buffer_count=NVME_OPTIMIZER_BUFFERS, nvme_path=str(nvme))
    zero.update(sub_group_size=sub_group_size, stage3_max_reuse_distance=0)
    ds["train_batch_size"] = ranks
    ds["train_micro_batch_size_per_gpu"] = 1
    return ds


def default_layers(ram: int, train_embeddings: bool) -> int:
    """The smallest N whose state (params + grads + fp32 masters + Adam moments + z/u) exceeds 1.5x ``ram``."""
    from elsa_ds.capacity.shapes import state_bytes

    for n in range(1, 47):
        if state_bytes(_shape(n, train_embeddings)) > 1.5 * ram:
            return n
    raise SystemExit("even 46 layers do not exceed 1.5x this machine's RAM")


def _config(layers: int) -> dict:
    """The shipped Gemma-2-27B config.json with ``layers`` decoder layers."""
    from elsa_ds.models import SHIPPED_CONFIGS

    config = json.loads((SHIPPED_CONFIGS / BASE_MODEL / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config.pop("layer_types", None)  # derived from the layer count by transformers
    return config


def _shape(layers: int, train_embeddings: bool):
    from transformers import AutoConfig

    from elsa_ds.capacity.memory import model_shape

    config = _config(layers)
    return model_shape(AutoConfig.for_model(**config), freeze_embeddings=not train_embeddings)


def phase_stats(series: list[tuple[float, float, float, float]], markers: list[dict], started: float, ended: float) -> list[dict]:
    """Per phase: peak RSS, peak NVMe bytes, lowest disk free, wall time (phases of the same name merged; load starts
    at the launch)."""
    cuts = [("load", started)] + [(m["phase"], m["t"]) for m in markers if m["phase"] not in ("load",)] + [("end", ended)]
    stats: dict[str, dict] = {}
    for (name, t0), (_, t1) in zip(cuts, cuts[1:]):
        if name in ("done", "end"):
            continue
        samples = [s for s in series if t0 <= s[0] < t1]
        row = stats.setdefault(name, {"phase": name, "wall_s": 0.0, "count": 0, "rss": 0.0, "nvme": 0.0, "disk_free": float("inf")})
        row["wall_s"] += t1 - t0
        row["count"] += 1
        for _, rss, nvme, free in samples:
            row["rss"], row["nvme"], row["disk_free"] = max(row["rss"], rss), max(row["nvme"], nvme), min(row["disk_free"], free)
    return [stats[p] for p in PHASE_ORDER if p in stats and stats[p]["rss"] > 0]  # a skipped phase has no samples


class Guard(threading.Thread):
    """Stops the job (its own process tree, by pid) when the machine's available memory falls below ``floor`` bytes:
    on a shared machine the OOM killer would otherwise pick any process."""

    def __init__(self, pid: int, floor: float):
        super().__init__(daemon=True)
        self.pid, self.floor, self.tripped = pid, floor, None
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.done.wait(0.2):
            available = psutil.virtual_memory().available
            if available < self.floor:
                self.tripped = available
                root = psutil.Process(self.pid)
                for proc in [*root.children(recursive=True), root]:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                return


def check_export(out: Path, sparsity: float) -> dict:
    """Load the export with from_pretrained; every decoder-layer Linear has exactly keep_count nonzeros."""
    import torch
    from transformers import AutoModelForCausalLM

    from elsa_ds.admm.projection import keep_count
    from elsa_ds.targets import select_targets

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    weights = dict(model.named_parameters())
    exact = {}
    for name in select_targets(model, None).values():
        w = weights[name]
        exact[name] = int((w != 0).sum()) == keep_count(w.numel(), sparsity)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return {"layers": len(exact), "exact": all(exact.values()), "tied_lm_head": tied, "params": sum(p.numel() for p in model.parameters())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers [the smallest N whose state > 1.5x RAM]")
    ap.add_argument("--deepspeed", default="ds_configs/zero3_nvme.json")
    ap.add_argument("--nvme_path", type=Path, default=None, help="swap folder [OUT/nvme]")
    ap.add_argument("--out", type=Path, default=None,
                    help="model, run, logs [a temporary folder beside --nvme_path, else in the current directory: "
                         "not /tmp, often RAM]")
    ap.add_argument("--ranks", type=int, default=1, help="ranks on this node [1: see bench/results/scale.md for 2]")
    ap.add_argument("--param_buffers", type=int, default=1, help="NVMe parameter swap buffers (each the embedding's share)")
    ap.add_argument("--sub_group_size", type=float, default=1e7)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.7)
    ap.add_argument("--train_embeddings", action="store_true", help="train the embedding too (default: --freeze_embeddings)")
    ap.add_argument("--markdown", type=Path, default=ROOT / "bench" / "results" / "scale.md")
    ap.add_argument("--keep", action="store_true", help="keep the exported model and the NVMe folder")
    ap.add_argument("--min_available_gib", type=float, default=1.5,
                    help="stop the job when the machine's available memory falls below this [1.5]")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from elsa_ds.capacity.ablation import TreeMonitor
    from elsa_ds.capacity.memory import estimate_job
    from elsa_ds.capacity.shapes import state_bytes
    from elsa_ds.zero.ds_config import DsConfig
    from elsa_ds.jobs.phases import PHASE_LOG_ENV, read_phases
    from elsa_ds.zero.dist import free_port

    ram = machine_ram()
    layers = args.layers or default_layers(ram, args.train_embeddings)
    shape = _shape(layers, args.train_embeddings)
    out = args.out or Path(tempfile.mkdtemp(prefix="elsa_bench_scale_", dir=str(args.nvme_path.parent) if args.nvme_path else os.getcwd()))
    nvme = args.nvme_path or out / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(out / "model", layers)
    largest_partition = -(-shape.largest_param // args.ranks)
    ds = fitted_config(args.deepspeed, largest_partition, args.ranks, args.param_buffers, args.sub_group_size, nvme)
    ds_path = out / "ds_config.json"
    ds_path.write_text(json.dumps(ds, indent=2) + "\n")
    state = state_bytes(shape)
    print(f"[bench/scale] Gemma-2-27B shapes, {layers} decoder layer(s): {shape.num_params / 1e9:.3f} B parameters "
          f"({shape.trainable_params / 1e9:.3f} B trained); state {state / GIB:.1f} GiB = {state / ram:.2f}x RAM "
          f"({ram / GIB:.1f} GiB); {args.ranks} ranks; out {out}", flush=True)
    print(f"[bench/scale] DeepSpeed config {ds_path}:\n{json.dumps(ds['zero_optimization'], indent=2)}", flush=True)

    uses_nvme = DsConfig(ds).uses_nvme  # --nvme_path only then: the job refuses it for another config
    settings = {"seqlen": args.seqlen, "freeze_embeddings": not args.train_embeddings,
                **({"nvme_path": str(nvme)} if uses_nvme else {})}
    est = estimate_job(str(model_dir), str(ds_path), args.ranks, settings=settings, device="cpu")
    run_dir = out / "run"
    prune_args = ["--deepspeed", str(ds_path), "--model", str(model_dir), "--random_init", "--dataset", "shakespeare",
                  "--seqlen", str(args.seqlen), "--batch_size", str(args.ranks), "--micro_batch", "1", "--steps", str(STEPS),
                  "--interval", str(INTERVAL), "--sparsity", str(args.sparsity), "--val_windows", "0", "--baseline", "none",
                  *(["--nvme_path", str(nvme)] if uses_nvme else []), "--output_dir", str(run_dir), "--overwrite",
                  "--no-freeze_embeddings" if args.train_embeddings else "--freeze_embeddings"]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.ranks), "--master_port", str(free_port()),
           str(ROOT / "launch" / "prune.py"), *prune_args]
    phase_log = out / "phases.jsonl"
    phase_log.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PHASE_LOG_ENV: str(phase_log)}
    print(f"[bench/scale] launch/prune.py {' '.join(prune_args)}", flush=True)
    started = time.time()
    with (out / "prune.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        monitor = TreeMonitor(proc.pid, nvme, period=0.25, record=True)
        guard = Guard(proc.pid, args.min_available_gib * GIB)
        monitor.start()
        guard.start()
        rc = proc.wait()
        monitor.done.set()
        guard.done.set()
        monitor.join()
    (out / "series.json").write_text(json.dumps({"started": started, "series": monitor.series,
                                                 "markers": read_phases(phase_log) if phase_log.exists() else []}))
    if guard.tripped is not None:
        print(f"[bench/scale] stopped the job: the machine had only {guard.tripped / GIB:.1f} GiB available")
    ended = time.time()
    tail = (out / "prune.log").read_text(errors="replace").splitlines()[-15:]
    if rc != 0:
        print("\n".join(tail))
        print(f"[bench/scale] the job failed with exit code {rc} after {ended - started:.0f} s; log {out / 'prune.log'}")
        if not args.keep:
            shutil.rmtree(nvme, ignore_errors=True)
        if args.json:
            print(json.dumps({"layers": layers, "rc": rc, "error": [l for l in tail if "error" in l.lower()][-1:]}))
        return rc
    markers = read_phases(phase_log)
    rows = compare(phase_stats(monitor.series, markers, started, ended), est)
    report = json.loads((run_dir / "elsa_report.json").read_text())
    export = {**check_export(run_dir, args.sparsity), "bytes": sum(f.stat().st_size for f in run_dir.glob("*.safetensors")),
              "files": sorted(f.name for f in run_dir.glob("*.safetensors*"))}
    result = {"layers": layers, "ranks": args.ranks, "num_params": shape.num_params, "trainable_params": shape.trainable_params,
              "state_bytes": state, "ram_bytes": ram, "deepspeed": ds["zero_optimization"], "seqlen": args.seqlen,
              "sparsity": args.sparsity, "phases": rows, "export": export,
              "peak_rss": monitor.peak_rss, "est_host": est.per_node_cpu_bytes, "host_ratio": est.per_node_cpu_bytes / monitor.peak_rss,
              "peak_build_rss": monitor.peak_build_rss,  # op builds (g++, ninja) at a fresh machine's first job: not in peak_rss
              "peak_nvme": monitor.peak_folder, "est_nvme": est.nvme_bytes, "nvme_ratio": est.nvme_bytes / monitor.peak_folder,
              "min_disk_free": min(x[3] for x in monitor.series), "wall_s": ended - started,
              "final_loss": report["final_loss"], "overall_sparsity": report["overall_sparsity"], "verified_layers": len(report["layers"])}
    table = markdown(result, args.deepspeed)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if not args.keep:
        shutil.rmtree(nvme, ignore_errors=True)
        for f in run_dir.glob("*.safetensors"):
            f.unlink()
    if args.json:
        print(json.dumps(result))
    return 0


def compare(rows: list[dict], est) -> list[dict]:
    """Each measured phase beside the estimator's prediction for it (a final projection is a projection)."""
    for row in rows:
        predicted = est.phases.get("projection" if row["phase"] == "final projection" else row["phase"])
        row["est"] = predicted["per_node_cpu"] if predicted else None
        row["ratio"] = row["est"] / row["rss"] if predicted and row["rss"] else None
    return rows


def markdown(r: dict, base: str) -> str:
    zero = r["deepspeed"]
    head = (f"ELSA at Gemma-2-27B shapes (`python bench/scale.py`): {r['layers']} decoder layer(s) of the shipped config "
            f"(hidden 4608, MLP 36864, vocabulary 256000), {r['num_params'] / 1e9:.3f} B parameters, {r['trainable_params'] / 1e9:.3f} B "
            f"trained (the embedding frozen); ZeRO-3 state (16-bit params + grads, fp32 masters, Adam moments, z, u) "
            f"{r['state_bytes'] / GIB:.1f} GiB = {r['state_bytes'] / r['ram_bytes']:.2f}x this machine's "
            f"{r['ram_bytes'] / GIB:.1f} GiB RAM. "
            f"{r['ranks']} rank(s), DeepSpeed's CPU accelerator (2 cores, no GPU), `{base}` with NVMe buffers fitted: parameter swapper "
            f"{zero['offload_param']['buffer_count']} x {zero['offload_param']['buffer_size']:,} elements, optimizer swapper "
            f"{zero['offload_optimizer']['buffer_count']} buffers, sub_group_size {zero['sub_group_size']:.0e}, max_in_cpu 0, "
            f"stage3_max_reuse_distance 0. {STEPS} steps (projection every {INTERVAL}), seqlen {r['seqlen']}, sparsity {r['sparsity']}, "
            f"random init, Shakespeare tokens.\n\n")
    lines = ["| phase | wall (s) | peak RSS, process tree (GiB) | estimated (GiB) | est/meas | NVMe files (GiB) | lowest disk free (GiB) |",
             "|---|---|---|---|---|---|---|"]
    for row in r["phases"]:
        est = "n/a" if row["est"] is None else f"{row['est'] / GIB:.2f}"
        ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(f"| {row['phase']}{'' if row['count'] == 1 else ' (x' + str(row['count']) + ')'} | {row['wall_s']:.0f} | "
                     f"{row['rss'] / GIB:.2f} | {est} | {ratio} | {row['nvme'] / GIB:.2f} | {row['disk_free'] / GIB:.1f} |")
    lines.append(f"| **whole run** | {r['wall_s']:.0f} | **{r['peak_rss'] / GIB:.2f}** | {r['est_host'] / GIB:.2f} | "
                 f"{r['host_ratio']:.2f} | **{r['peak_nvme'] / GIB:.2f}** (est {r['est_nvme'] / GIB:.2f}, "
                 f"{r['nvme_ratio']:.2f}) | {r['min_disk_free'] / GIB:.1f} |")
    e = r["export"]
    tail = (f"\nExport: {', '.join(e['files'])} ({e['bytes'] / GIB:.2f} GiB), loaded with `AutoModelForCausalLM.from_pretrained` "
            f"({e['params']:,} parameters, lm_head tied: {e['tied_lm_head']}); all {e['layers']} pruned weights hold exactly "
            f"keep_count nonzeros: {e['exact']} (the job's own check from the files: {r['verified_layers']} layers, overall sparsity "
            f"{r['overall_sparsity']:.4f}). Final loss {r['final_loss']:.3f} (random weights).\n")
    return head + "\n".join(lines) + "\n" + tail


if __name__ == "__main__":
    sys.exit(main())
