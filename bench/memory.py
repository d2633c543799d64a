"""Memory estimator vs measured peaks: the same short ELSA job under every shipped config, 1 and 2 ranks.

    python bench/memory.py                                   # 122M-parameter random Gemma-2, 4 configs x 1 and 2 ranks
    python bench/memory.py --ranks 1 --configs ds_configs/zero3_nvme.json --json
    python bench/memory.py --model DIR --out out/bench_memory
    python bench/memory.py --runtime                         # the per-process baseline behind memory.RUNTIME_HOST_BYTES
    python bench/memory.py --oneshot sparsegpt wanda magnitude --model DIR --seqlen 512   # one-shot jobs' host memory

Every run is a real ``launch/prune.py`` job (3 steps, projection interval 2: the first step, one
projection and the final one; seqlen 128, --val_windows 0 --baseline none) started through
``elsa_ds.capacity.ablation.run_ablation``, which samples the peak RSS of the whole process tree (launcher and
ranks) and the NVMe folder's size, and puts ``elsa_ds.capacity.memory.estimate`` for the same job beside them.
On a CUDA machine the peak GPU memory of rank 0 (``torch.cuda.max_memory_allocated``) is compared with
the estimate's per-GPU bytes without the CUDA context; without a GPU, DeepSpeed runs on its CPU
accelerator and "GPU" memory is host memory (estimated with ``device="cpu"``).

The default model is built once under OUT/model: one wide decoder layer (hidden 2048, MLP 16384, the
demo tokenizer), so that model state dominates the fixed process overhead (~26 bytes per parameter
against ~1.5 GB of runtime for 2 ranks) and every MLP weight of a rank is at least 32 MiB in fp32, as in
a real LLM: glibc then serves it with mmap and returns it on free. With many small tensors freed memory
stays in the heap and RSS exceeds the live bytes, which no config-only estimate can know.

``--oneshot`` runs instead each named one-shot method as its own ``launch/prune.py`` process (90 %, --nsamples
calibration sequences, --val_windows windows scored before and after, layer by layer on the CPU) and puts
``elsa_ds.capacity.memory.oneshot_host_bytes`` (what the pre-flight check refuses by) beside its peak RSS.

Prints one row per run: measured peak and estimate for host RSS, NVMe bytes (and GPU), est/measured and
whether it is within the tolerance (default ±15%); with --json the last line is a JSON object with the rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ["ds_configs/zero3.json", "ds_configs/zero3_offload.json", "ds_configs/zero3_offload_elsal.json", "ds_configs/zero3_nvme.json"]
WIDE = dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, head_dim=256)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
MIB = 2 ** 20


def build_model(out: Path, shape: dict) -> Path:
    """A random bf16 Gemma-2 of ``shape`` with the embedded demo's tokenizer (reused when already there)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    from elsa_ds.settings.config import DEMO_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    cfg = Gemma2Config(vocab_size=tok.vocab_size, max_position_embeddings=512, sliding_window=128,
                       pad_token_id=0, eos_token_id=1, bos_token_id=2, **shape)
    torch.manual_seed(0)
    Gemma2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def ratio(est: float, measured: float | None) -> float | None:
    if measured is None:
        return None
    if measured == 0:
        return 1.0 if est == 0 else float("inf")
    return est / measured


def within(r: float | None, tol: float) -> bool | None:
    return None if r is None else abs(r - 1.0) <= tol


def compare(rows, tol: float) -> list[dict]:
    out = []
    for r in rows:
        host, nvme = ratio(r.est_host_bytes, r.peak_host_rss_bytes), ratio(r.est_nvme_bytes, r.nvme_peak_bytes)
        gpu = ratio(r.est_gpu_bytes, r.peak_gpu_bytes)
        out.append({"config": r.config, "ranks": r.ranks,
                    "host_measured": r.peak_host_rss_bytes, "host_est": r.est_host_bytes, "host_ratio": host, "host_ok": within(host, tol),
                    "nvme_measured": r.nvme_peak_bytes, "nvme_est": r.est_nvme_bytes, "nvme_ratio": nvme, "nvme_ok": within(nvme, tol),
                    "gpu_measured": r.peak_gpu_bytes, "gpu_est": r.est_gpu_bytes if r.peak_gpu_bytes is not None else None,
                    "gpu_ratio": gpu, "gpu_ok": within(gpu, tol), "step_time_s": r.step_time_s})
    return out


def print_table(results: list[dict], tol: float) -> None:
    def mib(v):
        return "n/a" if v is None else f"{v / MIB:,.0f}"

    def rat(v):
        return "n/a" if v is None else f"{v:.3f}"

    def ok(v):
        return "n/a" if v is None else ("yes" if v else "NO")

    gpu = any(r["gpu_measured"] is not None for r in results)
    head = ["config", "ranks", "host MiB", "est MiB", "est/meas", f"±{tol:.0%}", "NVMe MiB", "est MiB", "est/meas", f"±{tol:.0%}"]
    if gpu:
        head += ["GPU MiB", "est MiB", "est/meas", f"±{tol:.0%}"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        cells = [r["config"], str(r["ranks"]), mib(r["host_measured"]), mib(r["host_est"]), rat(r["host_ratio"]), ok(r["host_ok"]),
                 mib(r["nvme_measured"]), mib(r["nvme_est"]), rat(r["nvme_ratio"]), ok(r["nvme_ok"])]
        if gpu:
            cells += [mib(r["gpu_measured"]), mib(r["gpu_est"]), rat(r["gpu_ratio"]), ok(r["gpu_ok"])]
        print("| " + " | ".join(cells) + " |")


def runtime_table(rows, raw_configs: dict[str, dict], out: Path) -> list[dict]:
    """Per-process baseline: a rank's peak RSS minus the estimate of everything but the runtime (≈ 0 on a tiny
    model, except NVMe's page-locked swap buffers), and the launcher's processes."""
    from elsa_ds.capacity.ablation import estimate_for_report

    result = []
    for r in rows:
        report = json.loads((out / f"ranks{r.ranks}" / "runs" / r.config / "elsa_report.json").read_text())
        est = estimate_for_report(raw_configs[r.config], report, r.ranks, device="cpu")
        runtime_node = est.breakdown["runtime"]["per_node_cpu"]
        rest_per_rank = (est.per_node_cpu_bytes - runtime_node) / r.ranks
        result.append({"config": r.config, "ranks": r.ranks, "rank_peak": r.peak_rank_rss_bytes, "rest_est": rest_per_rank,
                       "rank_runtime": r.peak_rank_rss_bytes - rest_per_rank, "launcher": r.launcher_rss_bytes})
    print("| config | ranks | rank peak MiB | estimate without runtime MiB | rank runtime MiB | launcher MiB |")
    print("|---|---|---|---|---|---|")
    for x in result:
        print(f"| {x['config']} | {x['ranks']} | {x['rank_peak'] / MIB:,.0f} | {x['rest_est'] / MIB:,.0f} | "
              f"{x['rank_runtime'] / MIB:,.0f} | {x['launcher'] / MIB:,.0f} |")
    from elsa_ds.capacity.memory import LAUNCHER_HOST_BYTES, RUNTIME_HOST_BYTES

    print(f"largest rank runtime {max(x['rank_runtime'] for x in result) / MIB:,.0f} MiB "
          f"(memory.RUNTIME_HOST_BYTES = {RUNTIME_HOST_BYTES / MIB:,.0f} MiB); largest launcher "
          f"{max(x['launcher'] for x in result) / MIB:,.0f} MiB (memory.LAUNCHER_HOST_BYTES = {LAUNCHER_HOST_BYTES / MIB:,.0f} MiB)")
    return result


def phase_peaks(series: list[tuple[float, float, float, float]], marks: list[dict]) -> dict[str, float]:
    """The largest sampled RSS in each phase (a phase lasts until the next marker; before the first: ``start``;
    a phase that recurs, as validation before and after pruning, keeps its largest)."""
    peaks: dict[str, float] = {}
    for t, rss, _folder, _free in series:
        phase = next((m["phase"] for m in reversed(marks) if m["t"] <= t), "start")
        peaks[phase] = max(peaks.get(phase, 0.0), rss)
    return peaks


def oneshot_rows(model: Path, methods: list[str], out: Path, args) -> list[dict]:
    """Each one-shot method as its own ``launch/prune.py`` process: its peak RSS beside ``oneshot_host_bytes``."""
    import os
    import subprocess

    from elsa_ds.capacity.ablation import TreeMonitor
    from elsa_ds.capacity.memory import model_shape, oneshot_host_bytes, resolve_model_config
    from elsa_ds.jobs.phases import PHASE_LOG_ENV, read_phases
    from elsa_ds.settings.config import ElsaConfig

    rows = []
    for method in methods:
        run = out / "oneshot" / method
        cmd = [sys.executable, str(ROOT / "launch" / "prune.py"), "--deepspeed", SHIPPED[0], "--method", method,
               "--model", str(model), "--dataset", args.dataset, "--seqlen", str(args.seqlen), "--sparsity", "0.9",
               "--nsamples", str(args.nsamples), "--val_windows", str(args.val_windows), "--output_dir", str(run), "--overwrite"]
        print(f"[bench/memory] {' '.join(cmd[1:])}", flush=True)
        run.parent.mkdir(parents=True, exist_ok=True)
        phase_log = out / f"oneshot_{method}.phases"
        phase_log.unlink(missing_ok=True)
        with (out / f"oneshot_{method}.log").open("w") as fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, PHASE_LOG_ENV: str(phase_log)})
            monitor = TreeMonitor(proc.pid, None, record=True)
            monitor.start()
            rc = proc.wait()
            monitor.done.set()
            monitor.join()
        if rc != 0:
            raise SystemExit(f"[bench/memory] {method} failed (exit {rc}); see {out / f'oneshot_{method}.log'}")
        cfg = ElsaConfig.model_validate(json.loads((run / "elsa_report.json").read_text())["config"])
        est = oneshot_host_bytes(model_shape(resolve_model_config(str(model)), cfg.targets), method, cfg, cuda=False)
        marks = read_phases(phase_log) if phase_log.is_file() else []
        peaks = phase_peaks(monitor.series, marks)
        print(f"[bench/memory] {method}: peak RSS by phase (MiB): "
              + ", ".join(f"{k} {v / MIB:,.0f}" for k, v in peaks.items()), flush=True)
        host = ratio(est, monitor.peak_rss)
        rows.append({"config": f"oneshot {method}", "ranks": 1, "phase_peaks": peaks, "host_measured": monitor.peak_rss, "host_est": est,
                     "host_ratio": host, "host_ok": within(host, args.tolerance),
                     "nvme_measured": 0.0, "nvme_est": 0.0, "nvme_ratio": 1.0, "nvme_ok": True, "gpu_measured": None,
                     "gpu_est": None, "gpu_ratio": None, "gpu_ok": None, "step_time_s": None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model directory [build a random wide Gemma-2 under OUT/model]")
    ap.add_argument("--configs", nargs="+", default=SHIPPED)
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--out", type=Path, default=None, help="runs, logs, NVMe swap folders [a temporary directory]")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--runtime", action="store_true", help="measure the per-process baseline on a 0.3M-parameter model instead")
    ap.add_argument("--oneshot", nargs="+", choices=["sparsegpt", "wanda", "magnitude"], default=None,
                    help="run these one-shot methods (one process each) instead of the ELSA configs")
    ap.add_argument("--nsamples", type=int, default=32, help="--oneshot: calibration sequences")
    ap.add_argument("--val_windows", type=int, default=8, help="--oneshot: validation windows scored before and after")
    ap.add_argument("--dataset", default="shakespeare", help="--oneshot: the calibration text")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from elsa_ds.capacity.ablation import run_ablation
    from elsa_ds.capacity.memory import model_shape, resolve_model_config
    from elsa_ds.zero.ds_config import DsConfig

    out = args.out or Path(tempfile.mkdtemp(prefix="elsa_bench_memory_"))
    configs = [str(Path(c)) for c in args.configs]
    raw_configs = {Path(c).stem: DsConfig.load(c).raw for c in configs}  # every config readable before the first run
    model = args.model or build_model(out / ("tiny_model" if args.runtime else "model"), TINY if args.runtime else WIDE)
    shape = model_shape(resolve_model_config(str(model)))
    prune_args = ["--model", str(model), "--dataset", "shakespeare", "--steps", str(args.steps), "--interval", "2",
                  "--seqlen", str(args.seqlen), "--val_windows", "0", "--baseline", "none"]
    print(f"[bench/memory] model {model}: {shape.num_params:,} parameters ({shape.pruned_params:,} pruned, largest pruned weight "
          f"{shape.largest_pruned_param:,}); configs {', '.join(raw_configs)}; ranks {args.ranks}; out {out}", flush=True)
    print(f"[bench/memory] launch/prune.py {' '.join(prune_args)}", flush=True)

    rows = []
    for ranks in args.ranks if not args.oneshot else []:
        rows += run_ablation(configs, out / f"ranks{ranks}", ranks, prune_args)
    if args.oneshot:
        result = oneshot_rows(model, args.oneshot, out, args)
        print_table(result, args.tolerance)
    elif args.runtime:
        result = runtime_table(rows, raw_configs, out)
    else:
        result = compare(rows, args.tolerance)
        print_table(result, args.tolerance)
        if all(r["gpu_measured"] is None for r in result):
            print("no GPU: DeepSpeed ran on its CPU accelerator, so GPU-side memory (activations, gathered parameters, "
                  "buckets, the step's temporaries) is host memory, measured and estimated with it")
    if not args.runtime:
        bad = [f"{r['config']} x{r['ranks']} {k}" for r in result for k in ("host", "nvme", "gpu") if r[f"{k}_ok"] is False]
        print("all within ±{:.0%}".format(args.tolerance) if not bad else "outside ±{:.0%}: {}".format(args.tolerance, ", ".join(bad)))
    if args.json:
        print(json.dumps({"model": str(model), "num_params": shape.num_params, "tolerance": args.tolerance,
                          "runtime" if args.runtime else "rows": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
