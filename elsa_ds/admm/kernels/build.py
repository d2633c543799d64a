"""JIT build of the fused ADMM kernels, the way DeepSpeed builds its CPU ops.

The C++ sources in ``csrc/`` are compiled on first use with ``torch.utils.cpp_extension.load``
(-O3, -march=native, OpenMP) and cached under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``). The module name carries a hash of the sources and flags, so an edited
kernel is rebuilt and never mistaken for a stale one. ``ELSA_DS_KERNELS=0`` turns the kernels off
(every caller then takes the eager path, the readable reference); a failed build says why once and
does the same.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from types import ModuleType

from elsa_ds.admm.kernels.build_lock import clear_stale_locks, extensions_root
from elsa_ds.log import get_logger

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bindings.cpp", "xstep.cpp", "xstep8bit.cpp", "select.cpp")
HEADERS = ("kernels.h", "numerics.h", "plan.h", "quant8.h", "span8_avx512.h")
# -ffp-contract=off: every fused multiply-add is written out (std::fma) where DeepSpeed's SIMD code has one,
# so results do not depend on what the compiler chooses to contract.
# -fno-thread-jumps: GCC 12's jump threading turns the fp8 conversion's selects into branches with the store of z
# duplicated into each; without AVX-512's masked byte stores the split loop then cannot be if-converted and stays
# scalar (ELSA-L's split 6x slower on an AVX2 machine). Nothing in these loops gains from jump threading.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fno-thread-jumps",
          "-Wno-unknown-pragmas"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_cache: dict[str, ModuleType | None] = {}
log = get_logger(__name__)


OFF = ("0", "false", "off", "no")
ON_OFF = ("1", "true", "on", "yes", *OFF)  # what an on/off switch of the environment takes; empty or unset: its default


def enabled() -> bool:
    """False when the user switched the kernels off with ``ELSA_DS_KERNELS=0``."""
    return (os.environ.get("ELSA_DS_KERNELS") or "1").strip().lower() not in OFF


def switch_problem(name: str, known: tuple[str, ...] = ON_OFF) -> str | None:
    """What is wrong with the switch ``name`` in the environment (one line, what to do), None when it is unset, empty or
    one of ``known`` (compared stripped, in lower case, as the readers read them)."""
    value = os.environ.get(name, "")
    if value.strip() and value.strip().lower() not in known:
        return f"{name}={value[:40]!r} is not a value it takes: choose {' or '.join(known)}, or unset it"
    return None


def module_name() -> str:
    """``elsa_admm_<hash>``: a hash of every source, header and flag, so edits never reuse a stale build."""
    return extension_name("elsa_admm", CSRC, SOURCES + HEADERS)


def extension_name(prefix: str, csrc: Path, files: tuple[str, ...]) -> str:
    """``<prefix>_<hash>`` of the files in ``csrc``, the flags and the CPU's instruction-set flags."""
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode())
        h.update((csrc / name).read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(_cpu_features().encode())  # -march=native: a cache shared with another CPU must not load this build
    return f"{prefix}_{h.hexdigest()[:12]}"


def _cpu_features() -> str:
    """The instruction-set flags -march=native compiles for (Linux: /proc/cpuinfo), else the machine's name."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine()


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled kernels, built on first call (minutes once, then cached); None when disabled or unbuildable."""
    return load_extension("elsa_admm", CSRC, SOURCES, HEADERS, "fused ADMM kernels", verbose)


def load_extension(prefix: str, csrc: Path, sources: tuple[str, ...], headers: tuple[str, ...], what: str,
                   verbose: bool = False) -> ModuleType | None:
    """Any of the project's C++ extensions (``csrc``'s sources, same flags and cache); None when disabled or unbuildable.

    ``what`` names it in the one-line notice a failed build prints (the caller then runs its torch reference).
    """
    if not enabled():
        return None
    name = extension_name(prefix, csrc, sources + headers)
    with _lock:
        if name not in _cache:
            _cache[name] = _build(name, csrc, sources, what, verbose)
        return _cache[name]


def _build(name: str, csrc: Path, sources: tuple[str, ...], what: str, verbose: bool) -> ModuleType | None:
    try:
        from torch.utils import cpp_extension

        root = extensions_root()
        clear_stale_locks(root, name)  # a build killed outright left its lock: torch would wait on it forever
        if not any(root.glob(f"{name}/{name}.so")) and not any(root.glob(f"*/{name}/{name}.so")):  # torch's own layouts
            log.info(f"building the {what} for this CPU (once; about half a minute on 2 cores, then cached under {root}; "
                     "ELSA_DS_KERNELS=0 skips it)")  # a first use on this machine waits on the compiler: say so
        return cpp_extension.load(
            name=name, sources=[str(csrc / s) for s in sources], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(csrc)], verbose=verbose,
        )
    except Exception as err:  # no compiler, no ninja, a build error: say so once, run the eager reference
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning(f"{what} unavailable ({first}); using the eager path")
        return None
