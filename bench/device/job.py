"""One pruning job of the device kit, run and checked: wall time, peak GPU memory and host RSS against the estimator,
exact per-layer sparsity, the export reloaded with from_pretrained, and its mask against a reference run's.

    python bench/device/job.py --config ds_configs/zero3_offload.json --out W/offload --figures F.json -- --steps 32
    python bench/device/job.py --config ds_configs/zero3_offload.json --out W/cpu --cpu -- --steps 32      # CUDA hidden
    python bench/device/job.py --compare W/offload W/cpu --figures F.json --min_agreement 0.97

The job is the README's: ``deepspeed --num_gpus 1 launch/prune.py --deepspeed CONFIG --output_dir OUT`` plus the
arguments after ``--``. ``--cpu`` runs it as one plain process with CUDA hidden (DeepSpeed's CPU accelerator, gloo): the CPU reference.
Host RSS is the largest resident set of any process of the job (getrusage of the waited-for children).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(config: str, out: Path, extra: list[str], cpu: bool) -> dict:
    """Launch the job; its wall time, exit code and largest host RSS."""
    launcher = shutil.which("deepspeed") or shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    # the CPU reference runs as a plain process (one rank): the deepspeed launcher would set CUDA_VISIBLE_DEVICES=0 again
    head = [sys.executable] if cpu else [launcher, "--num_gpus", "1", "--master_port", str(_port())]
    cmd = [*head, str(ROOT / "launch" / "prune.py"), "--deepspeed", config, "--output_dir", str(out), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    print("[job]", " ".join(cmd), "(CUDA hidden)" if cpu else "", flush=True)
    start = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return {"rc": rc, "wall_s": round(time.perf_counter() - start, 1), "host_rss_peak_bytes": rss}


def report_figures(out: Path) -> dict:
    """What the job's report says about the device path: step time, peak GPU bytes, kernels, sparsity."""
    report = json.loads((out / "elsa_report.json").read_text())
    keys = ("world_size", "steps", "step_time_s", "peak_gpu_bytes", "overall_sparsity", "kernels", "offload", "wall_s",
            "final_loss", "ppl", "residual")
    return {k: report.get(k) for k in keys}


def estimate(config: str) -> dict:
    """The estimator's figures for this job on 1 GPU (the job's own model, the demo's unless overridden)."""
    from elsa_ds.capacity.memory import estimate_job

    est = estimate_job(str(ROOT / "elsa_ds" / "demo" / "model"), config, 1)
    return {"per_gpu_bytes": est.per_gpu_bytes, "per_node_cpu_bytes": est.per_node_cpu_bytes}


def reload(out: Path) -> dict:
    """The export reloaded with from_pretrained; pruned layers' zeros counted, one forward pass on the device."""
    import torch
    from transformers import AutoModelForCausalLM

    report = json.loads((out / "elsa_report.json").read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    params = dict(model.named_parameters())
    wrong = [name for name, layer in report["layers"].items()
             if name in params and int((params[name] == 0).sum()) != layer["zeros"]]
    ids = torch.arange(1, 33, device=device).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return {"reloaded_layers": len(report["layers"]), "zeros_mismatch": wrong, "logits_finite": bool(torch.isfinite(logits).all())}


def masks(out: Path) -> dict:
    from safetensors.torch import load_file

    report = json.loads((out / "elsa_report.json").read_text())
    weights = {}
    for f in sorted(out.glob("*.safetensors")):
        weights.update(load_file(f))
    return {name: weights[name] != 0 for name in report["layers"] if name in weights}


def compare(run: Path, reference: Path) -> dict:
    """Mask agreement of ``run`` with ``reference`` (same layers, same sparsity), overall and the worst layer."""
    a, b = masks(run), masks(reference)
    if set(a) != set(b) or not a:
        return {"agreement": 0.0, "layers": len(a), "reference_layers": len(b), "error": "different pruned layers"}
    agree = {n: float((a[n] == b[n]).float().mean()) for n in a}
    total = sum(int((a[n] == b[n]).sum()) for n in a) / sum(a[n].numel() for n in a)
    worst = min(agree, key=agree.get)
    return {"agreement": round(total, 6), "worst_layer": worst, "worst_agreement": round(agree[worst], 6), "layers": len(a)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cpu", action="store_true", help="hide CUDA: the CPU reference run")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("RUN", "REFERENCE"))
    ap.add_argument("--min_agreement", type=float, default=0.97)
    ap.add_argument("--figures", type=Path)
    ap.add_argument("extra", nargs="*", help="arguments for launch/prune.py (after --)")
    args = ap.parse_args()
    if args.compare:
        fig = compare(*args.compare)
        ok = fig["agreement"] >= args.min_agreement
        fig["min_agreement"] = args.min_agreement
    else:
        fig = run_job(args.config, args.out, args.extra, args.cpu)
        ok = fig["rc"] == 0 and (args.out / "elsa_report.json").is_file()
        if ok:
            fig.update(report_figures(args.out))
            fig["estimate"] = estimate(args.config)
            fig["reload"] = reload(args.out)
            ok = not fig["reload"]["zeros_mismatch"] and fig["reload"]["logits_finite"]
    print("[job]", json.dumps(fig), flush=True)
    if args.figures:
        args.figures.write_text(json.dumps(fig, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
