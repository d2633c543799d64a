"""Offload ablation: the same short ELSA run under several DeepSpeed configs, measured side by side.

Each run is a real ``launch/prune.py`` job in its own process tree; a monitor thread samples the tree's
resident memory (and the NVMe swap folder's size) while it runs. The estimator's prediction for the
same model and config stands beside every measurement: on a machine without GPU DeepSpeed runs on its CPU
accelerator, so the estimate is made for ``device="cpu"`` (what would sit on the GPU is host memory).
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from elsa_ds.capacity.memory import Estimate, estimate, model_shape, resolve_model_config
from elsa_ds.errors import ElsaError, require
from elsa_ds.files.io import make_folder, write_atomic
from elsa_ds.log import get_logger
from elsa_ds.settings.config import resolve_config
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
log = get_logger(__name__)


@dataclass
class AblationRow:
    config: str
    step_time_s: float
    peak_host_rss_bytes: float
    est_host_bytes: float
    peak_gpu_bytes: float | None
    est_gpu_bytes: float          # what the allocator should see (torch.cuda.max_memory_allocated): no CUDA context
    nvme_peak_bytes: float
    est_nvme_bytes: float
    final_loss: float
    mask_agreement: float
    admm_state_bytes_per_param: float
    ranks: int = 1
    peak_rank_rss_bytes: float = 0.0      # the largest peak of one rank process
    launcher_rss_bytes: float = 0.0       # the deepspeed launcher's processes (runner, launch.py) together, at their peak
    build_rss_bytes: float = 0.0          # an op build's compilers at their peak (not in peak_host_rss_bytes)
    est_step_time_s: float = 0.0          # elsa-estimate's step time, as the report averages it, at rates measured here
    est_micro_step_s: float | None = None  # the micro-step it timed here (probe.measure_job); None: priced from the rates
    # the job's optimizer step and one projection timed here, in DeepSpeedCPUAdam steps (optimizer_probe); None: the
    # profile's ratios (the optimizer on the GPU, or nothing could be timed)
    est_optimizer_step: float | None = None
    est_projection: float | None = None


# the processes of an op build (DeepSpeed's and elsa_ds's kernels, compiled at a fresh machine's first job: ~2 GiB of
# cc1plus beside the ranks), named as the kernel names them (``g++-12``, ``x86_64-linux-gnu-g++`` included)
BUILD_TOOL = re.compile(r"(^|-)(ninja|cc1plus|cc1|collect2|lto1|lto-wrapper|ld(\.\w+)?|as|gcc|g\+\+|c\+\+|cc|clang|clang\+\+|nvcc|cicc"
                        r"|ptxas|fatbinary|nvlink|cudafe\+\+)(-[\d.]+)?$")


def process_kind(proc) -> str:
    """"launcher" (deepspeed's runner and launch.py, by their command line), "build" (a compiler or ninja) or "rank"."""
    if BUILD_TOOL.search(proc.name()):
        return "build"
    return "launcher" if "deepspeed.launcher" in " ".join(proc.cmdline()) else "rank"


class TreeMonitor(threading.Thread):
    """Samples the peak summed RSS of a process and its descendants, and the peak size of a folder.

    Also kept: the largest peak of one rank process, and the launcher processes' (deepspeed's runner and
    launch.py, told apart by their command line) summed peak. An op build's compilers are kept apart
    (``peak_build_rss``): a fresh machine's first job compiles, later ones load the build, and the job's own
    memory is what the estimate is for. With ``record``, every sample is kept in ``series`` as (time since the epoch,
    summed RSS, folder bytes, free bytes on the folder's file system).
    """

    def __init__(self, pid: int, folder: Path | None, period: float = 0.1, record: bool = False):
        super().__init__(daemon=True)
        self.pid, self.folder, self.period, self.record = pid, folder, period, record
        self.peak_rss = 0.0
        self.peak_rank_rss = 0.0
        self.peak_launcher_rss = 0.0
        self.peak_build_rss = 0.0
        self.peak_folder = 0.0
        self.series: list[tuple[float, float, float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self.done.is_set():
            rss, folder = 0.0, 0.0
            try:
                sizes = []
                for proc in [root, *root.children(recursive=True)]:
                    try:  # its kind at each sample: seen between fork and exec, a compiler has its parent's name (CI,
                        sizes.append((process_kind(proc), float(proc.memory_info().rss)))  # a kind once kept: a flake)
                    except psutil.Error:
                        continue
                by_kind = {kind: [v for k, v in sizes if k == kind] for kind in ("launcher", "build", "rank")}
                rss = sum(by_kind["launcher"]) + sum(by_kind["rank"])
                self.peak_rss = max(self.peak_rss, rss)
                self.peak_launcher_rss = max(self.peak_launcher_rss, sum(by_kind["launcher"]))
                self.peak_build_rss = max(self.peak_build_rss, sum(by_kind["build"]))
                self.peak_rank_rss = max([self.peak_rank_rss, *by_kind["rank"]])
            except psutil.Error:
                pass
            if self.folder is not None and self.folder.exists():
                try:
                    folder = float(sum(_size(f) for f in self.folder.rglob("*")))
                except OSError:  # a sub-folder removed while it was walked: the next sample counts again
                    folder = self.peak_folder if not self.series else self.series[-1][2]
                self.peak_folder = max(self.peak_folder, folder)
            if self.record:
                free = shutil.disk_usage(self.folder).free if self.folder is not None and self.folder.exists() else 0.0
                self.series.append((time.time(), rss, folder, float(free)))
            time.sleep(self.period)


def _size(path: Path) -> int:
    """Bytes of a file (0 for a folder, or a file deleted while the folder is walked)."""
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0


def _masks(out: Path):
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(out.glob("*.safetensors")):
        weights.update(load_file(f))
    layers = json.loads((out / "elsa_report.json").read_text())["layers"]
    return {k: weights[k] != 0 for k in layers}


def run_ablation(configs: list[str], out_dir: Path, ranks: int, prune_args: list[str],
                 run_env: Callable[[str], dict[str, str]] | None = None) -> list[AblationRow]:
    """Run ``launch/prune.py`` once per config with ``prune_args``; returns one row per config. ``run_env(name)``: more
    environment for the run of config ``name`` (a bench's step profile: its own file per run)."""
    import torch

    from elsa_ds.capacity.step_time import DEFAULT_MACHINE, TYPICAL, measure

    make_folder(out_dir / "runs")
    rows: list[AblationRow] = []
    reference = None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rates = measure(device, TYPICAL[DEFAULT_MACHINE[device]])  # before the runs, on the machine they run on
    for cfg_path in configs:
        view = DsConfig.load(cfg_path)
        name = Path(cfg_path).stem
        run_dir = out_dir / "runs" / name
        extra: list[str] = []
        nvme = None
        if view.uses_nvme:
            nvme = out_dir / "nvme" / name
            make_folder(nvme)
            extra = ["--nvme_path", str(nvme)]
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(free_port()),
               str(ROOT / "launch" / "prune.py"), "--deepspeed", cfg_path, *prune_args, *extra, "--output_dir", str(run_dir), "--overwrite"]
        log.info(f"ablation run {name}: {' '.join(cmd[3:])}")
        with (out_dir / f"{name}.log").open("w") as run_log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **(run_env(name) if run_env else {})}
            proc = subprocess.Popen(cmd, stdout=run_log, stderr=subprocess.STDOUT, env=env)
            monitor = TreeMonitor(proc.pid, nvme)
            monitor.start()
            rc = proc.wait()
            monitor.done.set()
            monitor.join()
        if rc != 0:
            said = [line for line in (out_dir / f"{name}.log").read_text(errors="replace").splitlines() if "elsa_ds: error" in line]
            raise ElsaError(f"ablation run {name} failed with exit code {rc}" + (f" ({said[0].strip()})" if said else "")
                            + f"; see {out_dir / (name + '.log')}")
        report = json.loads((run_dir / "elsa_report.json").read_text())
        masks = _masks(run_dir)
        reference = reference or masks
        agree = sum(int((masks[k] == reference[k]).sum()) for k in reference) / sum(m.numel() for m in reference.values())
        gpu_peak = report.get("peak_gpu_bytes")
        est = estimate_for_report(view.raw, report, ranks, device="cpu" if gpu_peak is None else "cuda")
        timed = step_time_for_report(view, report, ranks, "cpu" if gpu_peak is None else "cuda", rates)
        rows.append(AblationRow(
            config=name, step_time_s=report["step_time_s"], peak_host_rss_bytes=monitor.peak_rss,
            est_host_bytes=est.per_node_cpu_bytes, peak_gpu_bytes=gpu_peak,
            est_gpu_bytes=est.per_gpu_bytes - est.breakdown["runtime"]["per_gpu"], nvme_peak_bytes=monitor.peak_folder,
            est_nvme_bytes=est.nvme_bytes, final_loss=report["final_loss"], mask_agreement=agree,
            admm_state_bytes_per_param=report["admm_state_bytes_per_param"], ranks=ranks,
            peak_rank_rss_bytes=monitor.peak_rank_rss, launcher_rss_bytes=monitor.peak_launcher_rss,
            build_rss_bytes=monitor.peak_build_rss,
            est_step_time_s=timed.report_mean(), est_micro_step_s=timed.timed["micro_step_s"] if timed.timed else None,
            est_optimizer_step=(timed.optimizer_timed or {}).get("kernel"),
            est_projection=(timed.optimizer_timed or {}).get("projection"),
        ))
    write_outputs(rows, out_dir)
    return rows


def estimate_for_report(raw: dict, report: dict, ranks: int, device: str) -> Estimate:
    """The estimator's prediction for the job an ``elsa_report.json`` describes (same model, config, batch, ranks)."""
    cfg = resolve_config(raw, {"model": report["model"]})
    return estimate(model_shape(resolve_model_config(report["model"]), cfg.targets), raw, num_gpus=ranks,
                    micro_batch=report["config"]["micro_batch"], seqlen=report["config"]["seqlen"], elsa=report["config"],
                    gradient_checkpointing=report["config"]["gradient_checkpointing"], device=device)


def step_time_for_report(view: DsConfig, report: dict, ranks: int, device: str, rates):
    """elsa-estimate's step time for the job an ``elsa_report.json`` describes, its engine config resolved as the job
    resolved it, against ``rates`` (the matmul's timed again at the job's own shape, the job's optimizer timed here:
    ``optimizer_probe``) and, as ``--measure`` does, the job's micro-step timed here where it is cheap
    (``probe.measure_job``)."""
    from elsa_ds.capacity.memory import resolved_job
    from elsa_ds.capacity.optimizer_probe import measure_optimizer
    from elsa_ds.capacity.probe import measure_job
    from elsa_ds.capacity.step_time import job_matmul, matmul_rate, step_time
    from elsa_ds.settings.config import ElsaConfig

    cfg = ElsaConfig.model_validate(report["config"])
    shape, ds = resolved_job(cfg, view, ranks)
    rates = replace(rates, matmul_flops=matmul_rate(device, *job_matmul(shape, ds, cfg)))  # the job's own matmul
    return step_time(shape, ds, cfg, ranks, 1, device, rates, measure_job(shape, ds, cfg, ranks, 1, device, rates.matmul_flops),
                     measure_optimizer(cfg, view))


def write_outputs(rows: list[AblationRow], out_dir: Path) -> None:
    """ablation.csv, ablation.md and ablation.png, each by ``write_atomic`` (a full disk: one line, no temp file left, the
    last table whole; a third audit found fixed temp names left half-written, and written through a link)."""
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=list(asdict(rows[0])))
    writer.writeheader()
    writer.writerows(asdict(r) for r in rows)
    write_atomic(out_dir / "ablation.csv", table.getvalue())
    mib = 2 ** 20

    def fmt(v, scale=mib):
        return "n/a" if v is None else f"{v / scale:,.0f}"

    lines = ["| config | step time (s) | estimated (s) | peak host RSS (MiB) | estimated (MiB) | peak GPU (MiB) | "
             "estimated GPU (MiB) | NVMe peak (MiB) | estimated NVMe (MiB) | final loss | mask agreement | ADMM bytes/param |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:  # how each step was estimated: its micro-step timed here, or the machine's typical rates (a walk)
        how = "timed" if r.est_micro_step_s is not None else "rates"
        gpu = None if r.peak_gpu_bytes is None else r.est_gpu_bytes  # CPU ranks: no GPU to estimate
        lines.append(f"| {r.config} | {r.step_time_s:.3f} | {r.est_step_time_s:.3f} ({how}) | {fmt(r.peak_host_rss_bytes)} | "
                     f"{fmt(r.est_host_bytes)} | {fmt(r.peak_gpu_bytes)} | {fmt(gpu)} | {fmt(r.nvme_peak_bytes)} | "
                     f"{fmt(r.est_nvme_bytes)} | "
                     f"{r.final_loss:.4f} | {r.mask_agreement:.4%} | {r.admm_state_bytes_per_param:.2f} |")
    lines.append("\nestimated (s): (timed) from the job's micro-step timed on this machine, (rates) from its typical rates "
                 "where the micro-step could not be timed here (elsa-estimate --measure says why)")
    if built := [r for r in rows if r.build_rss_bytes]:
        lines.append(f"\npeak host RSS leaves out the op builds a fresh machine compiles at its first job (g++, ninja): "
                     + ", ".join(f"{r.config} {fmt(r.build_rss_bytes)} MiB" for r in built))
    write_atomic(out_dir / "ablation.md", "\n".join(lines) + "\n")

    matplotlib = require("matplotlib", "plot", "the ablation's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r.config for r in rows]
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r.step_time_s for r in rows], width=0.4, label="measured")
    axes[0].bar([i + 0.2 for i in x], [r.est_step_time_s for r in rows], width=0.4, label="estimated")
    axes[0].set_title("step time (s)")
    axes[0].legend()
    axes[1].bar([i - 0.2 for i in x], [r.peak_host_rss_bytes / mib for r in rows], width=0.4, label="measured")
    axes[1].bar([i + 0.2 for i in x], [r.est_host_bytes / mib for r in rows], width=0.4, label="estimated")
    axes[1].set_title("host memory (MiB)")
    axes[1].legend()
    axes[2].bar([i - 0.2 for i in x], [r.nvme_peak_bytes / mib for r in rows], width=0.4, label="measured")
    axes[2].bar([i + 0.2 for i in x], [r.est_nvme_bytes / mib for r in rows], width=0.4, label="estimated")
    axes[2].set_title("NVMe (MiB)" if any(r.nvme_peak_bytes or r.est_nvme_bytes for r in rows) else "NVMe: none of these configs")
    axes[2].set_ylim(bottom=0)
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    write_atomic(out_dir / "ablation.png", image.getvalue())
