"""launch/ablate_offload.py end to end: two real runs (CPU offload, NVMe offload) on 2 ranks, measured side by side;
the NVMe run also stands as the check that NVMe offload swaps the ADMM states and reproduces the CPU-offload mask."""
from __future__ import annotations

import csv
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, derived_config, run_entry
from tests.zero.test_offload_variants import ARGS, _masks

pytestmark = pytest.mark.integration


@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_offload_ablation_measures_each_config_beside_its_estimate(tmp_path, small_model_dir, text_dir):
    cpu_cfg = derived_config(tmp_path, bf16={"enabled": False})
    nvme_cfg = derived_config(tmp_path, "zero3_nvme.json", bf16={"enabled": False})
    out = tmp_path / "ablation"
    proc = run_entry("ablate_offload.py", ["--configs", str(cpu_cfg), str(nvme_cfg), "--out", str(out), "--num_gpus", "2",
                                           "--", "--model", str(small_model_dir), "--dataset", str(text_dir), *ARGS], timeout=1500)
    assert "(2 configs)" in proc.stdout
    rows = list(csv.DictReader((out / "ablation.csv").open()))
    assert [r["config"] for r in rows] == [cpu_cfg.stem, nvme_cfg.stem]
    cpu, nvme = ({k: float(v) for k, v in r.items() if k not in ("config", "peak_gpu_bytes")} for r in rows)
    assert cpu["mask_agreement"] == 1.0 and nvme["mask_agreement"] >= 0.999   # the NVMe run reproduces the CPU-offload mask
    assert cpu["nvme_peak_bytes"] == 0 and cpu["est_nvme_bytes"] == 0
    assert nvme["nvme_peak_bytes"] == pytest.approx(nvme["est_nvme_bytes"], rel=0.15)
    for row in (cpu, nvme):
        assert row["step_time_s"] > 0 and row["peak_host_rss_bytes"] > 0 and row["est_host_bytes"] > 0 and row["ranks"] == 2
        assert row["admm_state_bytes_per_param"] == pytest.approx(8.0, rel=1e-3)  # fp32 z and u (+ per-slice scales)
    # elsa-estimate's step time beside each, against rates measured before the runs; NVMe adds the states' traffic
    assert 0 < cpu["est_step_time_s"] < nvme["est_step_time_s"]
    assert all(r["peak_gpu_bytes"] == "" for r in rows)  # no GPU: DeepSpeed's CPU accelerator, nothing on a device
    table = (out / "ablation.md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in table[2:4]] == [f"| {cpu_cfg.stem}", f"| {nvme_cfg.stem}"]  # then its notes
    assert not [line for line in table[4:] if line.startswith("|")], table
    assert (out / "ablation.png").stat().st_size > 10_000
    # the NVMe run itself (it was tests/zero/test_offload_variants.py's own pair of runs): z, u and the Adam moments were
    # swapped to the NVMe folder while it ran (its sampled peak is the estimate of masters, moments, z and u, above; the
    # job removes its swap files at its end, tests/zero/test_nvme_swap.py, so their names are gone by now), the report
    # says so, and the export has exact sparsity in every pruned layer
    assert nvme["nvme_peak_bytes"] > 0 and not list((out / "nvme" / nvme_cfg.stem).rglob("*.tensor.swp"))
    nvme_masks, report = _masks(out / "runs" / nvme_cfg.stem)
    assert report["offload"] == {"offload_param": "nvme", "offload_optimizer": "nvme"}
    for name, mask in nvme_masks.items():
        assert int((~mask).sum()) == round(0.7 * mask.numel()), name


def test_bad_flags_after_the_separator_are_refused_before_any_run(tmp_path):
    """The flags for launch/prune.py are checked (parsed and resolved against every config) before the first run starts:
    one line naming the flag, exit 2, no output folder."""
    from tests.conftest import run_fails

    out = tmp_path / "ablation"
    for flags, needle in ((["--steps", "four"], "--steps: invalid int value: 'four'"), (["--sparsity", "1.5"], "sparsity=1.5")):
        run_fails("ablate_offload.py", ["--configs", "ds_configs/zero3_offload.json", "--out", str(out), "--", *flags], needle)
    assert not out.exists()
    # what only the job's plan finds (a user's walk, 2026-11-30: the later configs were checked when their turn came):
    # checkpoints under NVMe optimizer offload, refused before the first config's run, as that job would refuse it
    from elsa_ds.capacity.machine import nvme_unavailable

    needle = nvme_unavailable() or "--save_interval/--resume with NVMe optimizer offload is not supported"  # libaio first
    run_fails("ablate_offload.py", ["--configs", "ds_configs/zero3_offload.json", "ds_configs/zero3_nvme.json", "--out", str(out),
                                    "--", "--save_interval", "16"], needle)
    assert not out.exists()


def test_the_runs_outputs_together_are_checked_against_the_disk_before_any_run(tmp_path, monkeypatch):
    """Each run's own check sees the disk as it is, but the runs keep their outputs one after another and the NVMe run
    swaps beside them (the 27B-shaped ablation on the lent machine's 54 GiB disk): refused before the first run when
    all of it does not fit, though each run alone would."""
    import importlib.util
    import os

    from elsa_ds.capacity import machine, preflight
    from tests.conftest import ROOT
    from tests.inprocess import one_line, run_main

    spec = importlib.util.spec_from_file_location("ablate_offload", ROOT / "launch" / "ablate_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, configs = tmp_path / "ablation", ["ds_configs/zero3_offload.json", "ds_configs/zero3_nvme.json"]
    sizes = [module.check_run(c, tmp_path / "probe", 2, module.DEFAULT_PRUNE_ARGS) for c in configs]  # (makes its parents)
    alone, together = max(kept + swap for kept, swap in sizes), sum(kept for kept, _ in sizes) + max(swap for _, swap in sizes)
    assert sizes[1][1] > 0 and alone < together  # the NVMe run swaps, and the two outputs add up
    free = {os.stat(tmp_path).st_dev: (alone + together) / 2}  # the disk the job's own check and this one read
    monkeypatch.setattr(preflight, "this_machine", lambda paths: preflight.Machine(host=1e15, disks=free))
    monkeypatch.setattr(machine, "nvme_unavailable", lambda: None)  # checked above; its compile probe needs a real stderr
    code, err, _ = run_main(module.main, ["--configs", *configs, "--out", str(out)])
    one_line(code, err, "ablate_offload.py: the 2 runs keep", "fewer --configs")
    assert not out.exists()


def test_flags_after_the_double_dash_add_to_the_ablations_defaults_and_override_them():
    """A walk: ``-- --seqlen 128`` dropped every default (the runs trained the demo's 512 steps and validated)."""
    import importlib.util

    from elsa_ds.cli import prune_parser
    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("ablate_offload", ROOT / "launch" / "ablate_offload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [*module.prune_args(["--", "--seqlen", "128", "--steps", "8"]), "--deepspeed", "zero3", "--output_dir", "out/x"]
    args = prune_parser().parse_args(argv)
    assert (args.seqlen, args.steps, args.interval, args.val_windows, args.baseline) == (128, 8, 16, 0, "none")
    assert module.prune_args([]) == module.DEFAULT_PRUNE_ARGS


def test_the_table_says_how_each_step_was_estimated_and_what_cpu_ranks_have_no_gpu_for(tmp_path):
    """A walk: one row's estimate came from the typical rates (its micro-step could not be timed), another's from a timed
    micro-step, and the table did not say which; CPU ranks showed "n/a" beside an estimated GPU "0"."""
    pytest.importorskip("matplotlib")
    from elsa_ds.capacity.ablation import AblationRow, write_outputs

    row = dict(step_time_s=0.5, peak_host_rss_bytes=2 ** 30, est_host_bytes=2 ** 30, peak_gpu_bytes=None, est_gpu_bytes=0.0,
               nvme_peak_bytes=0.0, est_nvme_bytes=0.0, final_loss=4.0, mask_agreement=1.0, admm_state_bytes_per_param=8.0)
    write_outputs([AblationRow(config="zero3_offload", est_step_time_s=0.7, **row),
                   AblationRow(config="zero3_offload_elsal", est_step_time_s=0.46, est_micro_step_s=0.1, **row)], tmp_path)
    table = (tmp_path / "ablation.md").read_text().splitlines()
    assert "| 0.700 (rates) |" in table[2] and "| 0.460 (timed) |" in table[3]
    assert all(line.count("n/a") == 2 for line in table[2:4]) and "(rates) from its typical rates" in table[-1]
    assert (tmp_path / "ablation.png").stat().st_size > 0 and not list(tmp_path.glob("*.tmp*"))


def test_the_monitor_keeps_an_op_builds_compilers_apart_from_the_jobs_memory(tmp_path):
    """A walk (2026-12-04): zero3_nvme's row measured 6,468 MiB of host RSS on a fresh machine and 4,210 once its ops were
    built (estimated 4,064): the first job's compilers (cc1plus, ~2 GiB) were summed with its ranks. A tree of a "rank"
    holding 100 MiB and a "g++-12" (a Python started by that name) holding 300 MiB: the job's peak is the rank's. The
    compiler spends half a second between fork and exec, under its parent's name: a kind kept from that sample counted
    it as a rank (a CI flake, 2026-12-06, on a loaded box)."""
    from elsa_ds.capacity.ablation import TreeMonitor

    compiler = tmp_path / "g++-12"
    compiler.symlink_to(sys.executable)
    hold = "import time; b = b'x' * ({} << 20); time.sleep(4)"
    tree = textwrap.dedent(f"""
        import subprocess, sys, time
        procs = [subprocess.Popen([sys.executable, "-c", {hold.format(100)!r}]),
                 subprocess.Popen([{str(compiler)!r}, "-c", {hold.format(300)!r}], preexec_fn=lambda: time.sleep(0.5))]
        for p in procs:
            p.wait()
    """)
    root = subprocess.Popen([sys.executable, "-c", tree])
    monitor = TreeMonitor(root.pid, None, period=0.05)
    monitor.start()
    assert root.wait(timeout=60) == 0
    monitor.done.set()
    monitor.join()
    mib = 2 ** 20
    assert monitor.peak_build_rss >= 300 * mib and monitor.peak_rank_rss >= 100 * mib, vars(monitor)
    assert monitor.peak_rss < 250 * mib, vars(monitor)  # the rank, the root's interpreter: not the compiler's 300 MiB


def test_a_full_disk_at_the_table_is_one_line_and_leaves_the_last_one_whole(tmp_path):
    """A third audit: the table went to fixed temp names, left half-written on a full disk (ulimit -f here) with an
    OSError traceback, and written through a link planted at those names."""
    pytest.importorskip("matplotlib")
    (tmp_path / "ablation.csv").write_text("the last table\n")
    (tmp_path / "elsewhere.txt").write_text("mine")
    (tmp_path / "ablation.csv.tmp").symlink_to(tmp_path / "elsewhere.txt")
    code = textwrap.dedent("""
        import resource, signal, sys
        from pathlib import Path
        from elsa_ds.capacity.ablation import AblationRow, write_outputs
        from elsa_ds.errors import ElsaError
        row = AblationRow(config="c" * 5000, step_time_s=1.0, peak_host_rss_bytes=1, est_host_bytes=1, peak_gpu_bytes=None,
                          est_gpu_bytes=1, nvme_peak_bytes=1, est_nvme_bytes=1, final_loss=1.0, mask_agreement=1.0,
                          admm_state_bytes_per_param=1.0, est_step_time_s=1.0)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk's does
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            write_outputs([row], Path(sys.argv[1]))
        except ElsaError as err:
            print(err)
            sys.exit(2)
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "cannot write" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ablation.csv", "ablation.csv.tmp", "elsewhere.txt"]
    assert (tmp_path / "ablation.csv").read_text() == "the last table\n" and (tmp_path / "elsewhere.txt").read_text() == "mine"
