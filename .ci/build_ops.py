"""CI: JIT-build, before the tests, every C++ op they load: DeepSpeed's CPU ops (CPU Adam, NVMe async I/O, the
shared-memory all-reduce, pinned memory) and elsa_ds's own kernels (the fused ADMM step, the sparse decode kernel).

The builds are the same ``load()`` calls the code makes, so they land in the same cache (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``) and the tests find them there. On a fresh 2-core machine they take 5-11 minutes,
which the first test to use each op would otherwise pay: built here, pytest's own time is the tests'. A build that
fails is reported and left to the tests, which then say what they say without it.

Two lanes, each a process per op: NVMe async I/O (several sources, ~60 % of the work) beside the others in turn. A
one-source build keeps one core busy, so one after another they left the second core idle (670 s on a 2-core box
without AVX-512, 2026-11-29). Different ops never share a build folder or its lock.
"""
from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

DEEPSPEED_OPS = ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder", "PinMemoryBuilder")
OWN_OPS = ("admm", "sparse")
LANES = (("AsyncIOBuilder",), ("CPUAdamBuilder", "ShareMemCommBuilder", "PinMemoryBuilder", *OWN_OPS))


def build_one(name: str) -> int:
    """Build one op in this process; 0 when it is ready or not for this machine."""
    start = time.time()
    if name in DEEPSPEED_OPS:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"[build_ops] {name}: not for this machine, skipped", flush=True)
            return 0
        try:
            builder.load(verbose=False)
        except Exception as exc:  # noqa: BLE001 (reported; the tests then meet the same failure)
            print(f"[build_ops] {name}: FAILED ({exc})", flush=True)
            return 1
        print(f"[build_ops] {name}: ready in {time.time() - start:.0f} s", flush=True)
        return 0
    from elsa_ds.admm.kernels import build
    from elsa_ds.sparse import kernels

    load, what = {"admm": (build.load, "elsa_ds's fused ADMM kernels"), "sparse": (kernels.load, "elsa_ds's sparse decode kernel")}[name]
    ok = load() is not None
    print(f"[build_ops] {what}: {'ready' if ok else 'FAILED (see above)'} in {time.time() - start:.0f} s", flush=True)
    return 0 if ok else 1


def lane(names: tuple[str, ...]) -> list[str]:
    """Each op of ``names`` in its own process, one after another; the names of those that failed."""
    return [name for name in names if subprocess.run([sys.executable, __file__, name]).returncode != 0]


def main() -> int:
    start = time.time()
    with ThreadPoolExecutor(len(LANES)) as pool:
        failed = [name for names in pool.map(lane, LANES) for name in names]
    print(f"[build_ops] all: {time.time() - start:.0f} s{'; failed: ' + ', '.join(failed) if failed else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(build_one(sys.argv[1]) if len(sys.argv) > 1 else main())
