"""SparseGPT's inversion of a Hessian keeps at most two in x in copies beside the caller's: the largest one (the MLP's
down projection, in = its width) is a one-shot job's host peak, and ``oneshot_host_bytes`` counts two (8·in² bytes)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
from elsa_ds.oneshot.sparsegpt import _inverse_cholesky
n = 2048
a = torch.randn(n, 64)
H = a @ a.t()                 # the only in x in tensor before the call: no larger temporary raises the peak first
H.diagonal().add_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
U = _inverse_cholesky(H, 0.01)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"copies": (after - before) / (4 * n * n), "upper": bool(torch.equal(U, U.triu()))}))
"""


def test_the_inversion_holds_two_copies_of_the_hessian_at_most():
    proc = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["upper"]
    # the peak beyond the caller's H: the result and one temporary, never the clone and L beside them as well
    assert got["copies"] <= 3.0, got  # measured 2.5 (4.5 with the clone and L kept to the end)
