"""The device kit's bookkeeping: one JSON of timed steps, the environment, the wheel folder (bench/device/check.sh).

    python bench/device/kit.py init RESULTS --mode device|dry-run
    python bench/device/kit.py record RESULTS NAME RC SECONDS [FIGURES.json]    # one step; rc 124: timed out
    python bench/device/kit.py skip RESULTS NAME REASON
    python bench/device/kit.py env FIGURES.json                                  # GPU, driver, torch, deepspeed, nvcc, cores
    python bench/device/kit.py wheels WHEELS_DIR FIGURES.json                    # one release per package, names as pinned
    python bench/device/kit.py pytest-summary LOG FIGURES.json                   # passed / failed / skipped from pytest's last line

RESULTS holds {"mode", "started", "steps": [{"name", "status": ok | failed | timeout | skipped, "rc", "seconds", ...figures}]};
it is rewritten whole after each step (temp file, then rename), so a call cut short leaves every finished step readable.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def init(results: Path, mode: str) -> None:
    _write(results, {"mode": mode, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": []})


def record(results: Path, name: str, rc: int, seconds: float, figures: Path | None = None) -> None:
    status = "ok" if rc == 0 else "timeout" if rc in (124, 137) else "failed"
    step = {"name": name, "status": status, "rc": rc, "seconds": round(seconds, 1)}
    if figures is not None and figures.is_file() and figures.stat().st_size:
        try:
            step["figures"] = _read(figures)
        except json.JSONDecodeError as err:
            step["figures_error"] = str(err)
    data = _read(results)
    data["steps"].append(step)
    _write(results, data)
    print(f"[kit] {name}: {status} (rc {rc}, {seconds:.0f} s)", flush=True)


def skip(results: Path, name: str, reason: str) -> None:
    data = _read(results)
    data["steps"].append({"name": name, "status": "skipped", "reason": reason})
    _write(results, data)
    print(f"[kit] {name}: skipped ({reason})", flush=True)


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"unavailable ({type(err).__name__})"


def environment() -> dict:
    """What ran the check: GPU, driver, CUDA, torch, deepspeed, transformers, nvcc, cores, memory."""
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count(),
                   driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
    for module in ("deepspeed", "transformers", "triton", "pydantic"):
        try:
            env[module] = __import__(module).__version__
        except Exception as err:  # a missing package is what this step is there to show
            env[module] = f"unavailable ({type(err).__name__}: {err})"
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    env["nvcc"] = _run([nvcc, "--version"]).splitlines()[-1] if nvcc else None
    try:
        models = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
        env["cpu_model"] = models[0] if models else None
    except OSError:
        pass
    try:
        env["host_memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return env


def wheels(folder: Path) -> dict:
    """The wheel folder as pinned in packages.txt: every pinned release there once, nothing else, its size."""
    pinned = {}
    for line in (HERE / "packages.txt").read_text().splitlines():
        parts = line.split("#")[0].split()
        if len(parts) == 2 and parts[0] in ("wheel", "sdist"):
            name, version = parts[1].split("==")
            pinned[_norm(name)] = version
    found: dict[str, list[str]] = {}
    for whl in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            text = zf.read(meta).decode()
        name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
        version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
        found.setdefault(_norm(name), []).append(version)
    problems = [f"{n}: {v}" for n, v in found.items() if len(v) > 1]
    problems += [f"{n}=={v} missing" for n, v in pinned.items() if found.get(n) != [v]]
    problems += [f"{n} not pinned in packages.txt" for n in found if n not in pinned]
    size = sum(f.stat().st_size for f in folder.glob("*.whl"))
    return {"wheels": sum(len(v) for v in found.values()), "size_mib": round(size / 2**20, 2), "problems": problems}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pytest_summary(log: Path) -> dict:
    """Counts from pytest's final summary line (e.g. '3 passed, 1 skipped in 12.3s')."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1])} if lines else {}
    skipped = sorted({m for m in re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.+)", log.read_text(errors="replace"))})
    return {**counts, "skip_reasons": skipped}


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    if cmd == "init":
        init(Path(args[0]), args[2] if len(args) > 2 else "device")
    elif cmd == "record":
        record(Path(args[0]), args[1], int(args[2]), float(args[3]), Path(args[4]) if len(args) > 4 else None)
    elif cmd == "skip":
        skip(Path(args[0]), args[1], " ".join(args[2:]))
    elif cmd == "env":
        env = environment()
        print(json.dumps(env, indent=1))
        _write(Path(args[0]), env)
    elif cmd == "wheels":
        found = wheels(Path(args[0]))
        print(json.dumps(found))
        _write(Path(args[1]), found)
        return 1 if found["problems"] else 0
    elif cmd == "pytest-summary":
        _write(Path(args[1]), pytest_summary(Path(args[0])))
    else:
        print(f"kit.py: unknown command {cmd!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
