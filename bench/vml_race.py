"""oneMKL's VML first-call race (pytorch/pytorch#188792) as it reached this project, and the resolution's A/B.

    python bench/vml_race.py check --mkl_lib DIR [--json]
        recomputes a recorded failure of tests/admm/test_kernels.py (bench/results/vml_race_*.json: the fused pair's
        z after the first 8-bit Adam step) from its seeds, with ``v.sqrt()`` taken from oneMKL's AVX2 "EP" kernel
        (``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``vmlSetMode(VML_EP)``) and from torch's own call (VML_HA): the failure's
        values are bit for bit the EP ones, the eager pair's the HA ones. DIR: the ``lib`` folder of the ``mkl`` wheel
        torch's was built with (``pip download mkl==2024.2.0 --no-deps``, unzip, ``mkl-2024.2.0.data/data/lib``).
    python bench/vml_race.py storm [--processes N] [--json]
        N fresh processes each make their first VML call (``sqrt`` of 5,003 fp32 entries) on two threads, half of them
        after ``torch_api.resolve_mkl_vml()``; counts the calls whose result differs from a one-thread rerun. Rare on
        a 2-core box (0 in ~300 here); the issue's many-core Xeon saw ~5 % unresolved.

The last line is JSON with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

RECORD = Path(__file__).resolve().parent / "results" / "vml_race_2026-12-05_epyc.json"

# oneMKL in a process of its own (torch's MKL is linked in statically): vsSqrt of the saved v under VML_EP, AVX2
_EP_SQRT = """
import ctypes, os, sys
import numpy as np
os.environ["MKL_THREADING_LAYER"] = "SEQUENTIAL"
os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
rt = ctypes.CDLL(os.path.join(sys.argv[1], "libmkl_rt.so.2"), mode=ctypes.RTLD_GLOBAL)
v = np.load(sys.argv[2])
out = np.zeros_like(v)
rt.vmlSetMode(ctypes.c_uint(0x3))  # VML_EP
rt.vsSqrt(ctypes.c_int(len(v)), v.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p))
np.save(sys.argv[3], out)
"""

_FIRST_CALL = """
import sys, torch
torch.set_num_threads(2)
torch.ones(200_000).mul_(2.0)  # the intra-op pool up and waiting, as in a test worker
if sys.argv[1] == "resolved":
    from elsa_ds.torch_api import resolve_mkl_vml
    resolve_mkl_vml()
g = torch.randn(5003, generator=torch.Generator().manual_seed(2000))
v = torch.zeros(5003).addcmul_(g, g, value=1e-3)
first = v.sqrt()
torch.set_num_threads(1)
print(int((first != v.sqrt()).sum()))
"""


def _values(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _moments(rec: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, m, v of the first step of adam8bit_reference at the recorded entries (m, v from zero codes)."""
    at = torch.tensor(rec["entries"])
    beta1, beta2 = rec["betas"]
    x, g = _values(rec["x0_seed"], rec["numel"])[at], _values(rec["grad_seed"], rec["numel"])[at]
    m = torch.zeros_like(g).mul_(beta1).add_(g, alpha=1.0 - beta1)
    v = torch.zeros_like(g).mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    return x, m, v


def _first_step(rec: dict, sqrt_v: torch.Tensor | None) -> torch.Tensor:
    """x after that step, with ``sqrt_v`` in place of torch's ``v.sqrt()`` when given."""
    x, m, v = _moments(rec)
    beta1, beta2 = rec["betas"]
    denom = ((v.sqrt() if sqrt_v is None else sqrt_v) / math.sqrt(1.0 - beta2)).add_(rec["eps"])
    return x.addcdiv_(m, denom, value=-rec["lr"] / (1.0 - beta1))


def check(mkl_lib: Path) -> dict:
    import numpy as np

    rec = json.loads(RECORD.read_text())
    v = _moments(rec)[2]
    with tempfile.TemporaryDirectory() as tmp:
        np.save(f"{tmp}/v.npy", v.numpy())
        subprocess.run([sys.executable, "-c", _EP_SQRT, str(mkl_lib), f"{tmp}/v.npy", f"{tmp}/s.npy"], check=True)
        ep = torch.from_numpy(np.load(f"{tmp}/s.npy"))
    fused, eager = torch.tensor(rec["fused"]), torch.tensor(rec["eager"])
    with_ep, with_ha = _first_step(rec, ep), _first_step(rec, None)
    return {"record": RECORD.name, "fused_equals_ep_kernel": torch.equal(with_ep, fused),
            "eager_equals_torch_sqrt": torch.equal(with_ha, eager),
            "ep_sqrt_relative_error": (ep.double() / v.double().sqrt() - 1).tolist()}


def storm(processes: int) -> dict:
    counts: dict[str, list[int]] = {"unresolved": [], "resolved": []}
    for i in range(processes):
        arm = ("unresolved", "resolved")[i % 2]
        out = subprocess.run([sys.executable, "-c", _FIRST_CALL, arm], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent.parent)
        counts[arm].append(int(out.stdout.split()[-1]))
    return {arm: {"processes": len(c), "corrupted_first_calls": sum(1 for n in c if n)} for arm, c in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("check")
    c.add_argument("--mkl_lib", type=Path, required=True)
    s = sub.add_parser("storm")
    s.add_argument("--processes", type=int, default=40)
    for p in (c, s):
        p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.mode == "check" and not (args.mkl_lib / "libmkl_rt.so.2").is_file():
        parser.error(f"--mkl_lib {args.mkl_lib}: no libmkl_rt.so.2 there (the mkl wheel's mkl-*.data/data/lib folder)")
    result = check(args.mkl_lib) if args.mode == "check" else storm(args.processes)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
