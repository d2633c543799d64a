"""The adapter's checks that need no engine."""
from __future__ import annotations

import os
import time

from elsa_ds.zero.compat import STALE_LOCK_S, stale_build_locks


def test_an_abandoned_build_lock_is_reported_and_a_fresh_or_finished_one_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    killed, running, built = (tmp_path / "py311_cpu" / op for op in ("async_io", "cpu_adam", "shm_comm"))
    for d in (killed, running, built):
        d.mkdir(parents=True)
        (d / "lock").touch()
    (built / "shm_comm.so").touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(killed / "lock", (old, old))
    os.utime(built / "lock", (old, old))
    warnings = stale_build_locks()
    assert len(warnings) == 1 and str(killed / "lock") in warnings[0] and "delete it" in warnings[0]
