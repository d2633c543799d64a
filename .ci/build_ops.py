"""CI: JIT-build, before the tests, every C++ op they load: DeepSpeed's CPU ops (CPU Adam, NVMe async I/O, the
shared-memory all-reduce, pinned memory) and elsa_ds's own kernels (the fused ADMM step, the sparse decode kernel).

The builds are the same ``load()`` calls the code makes, so they land in the same cache (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``) and the tests find them there. On a fresh 2-core machine they take about five
minutes, which the first test to use each op would otherwise pay: built here, pytest's own time is the tests'. A build
that fails is reported and left to the tests, which then say what they say without it.
"""
from __future__ import annotations

import sys
import time


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    failed = []
    for name in ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder", "PinMemoryBuilder"):
        start = time.time()
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"[build_ops] {name}: not for this machine, skipped", flush=True)
            continue
        try:
            builder.load(verbose=False)
            print(f"[build_ops] {name}: ready in {time.time() - start:.0f} s", flush=True)
        except Exception as exc:  # noqa: BLE001 (reported; the tests then meet the same failure)
            failed.append(name)
            print(f"[build_ops] {name}: FAILED ({exc})", flush=True)
    from elsa_ds.admm.kernels import build
    from elsa_ds.sparse import kernels

    for what, load in (("elsa_ds's fused ADMM kernels", build.load), ("elsa_ds's sparse decode kernel", kernels.load)):
        start = time.time()
        ok = load() is not None
        print(f"[build_ops] {what}: {'ready' if ok else 'FAILED (see above)'} in {time.time() - start:.0f} s", flush=True)
        if not ok:
            failed.append(what)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
