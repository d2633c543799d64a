"""The optimizer step alone, the CPU-offload regime's bottleneck: ELSA's work vs the base optimizer's.

    python bench/optimizer_step.py                                   # 32M entries, 8 slices, interval 32
    python bench/optimizer_step.py --numel 8e6 32e6 128e6 --eager --json

One fp32 flat of ``numel`` entries cut into ``slices`` layer slices (one rank's partition of a ZeRO-3
sub-group), a fixed gradient, and per pair of optimizers blocks of ``interval`` steps in ABBA order (so
both see the same machine noise); medians per step. Pairs:

    DeepSpeedCPUAdam         vs  AdmmOptimizer(DeepSpeedCPUAdam), fp32 z/u           (ELSA)
    DeepSpeedCPUAdam         vs  AdmmOptimizer(Adam8bit, minifloat codes), fp8 z, bf16 u
                                                              (elsa_l_minifloat: --base_optimizer adam8bit_minifloat)
    DeepSpeedCPUAdam         vs  AdmmOptimizer(bitsandbytes Adam8bit), fp8 z, bf16 u
                                                              (elsa_l_bnb: --base_optimizer adam8bit, the paper's codes)
    bitsandbytes Adam8bit and the fused 8-bit Adam alone, in both code formats (few steps: bitsandbytes' CPU path is slow)

ELSA's blocks contain exactly one projection (step t with (t + 1) % interval == 0); the amortized step
is the plain step + projection / interval. ``--eager`` adds the eager reference (ELSA_DS_KERNELS=0's path);
``--remedies`` the authors' remedies (the adaptive λ, over-relaxation) on each base, kernels on, and their step and
projection against the fused ELSA's (the factors ``elsa_ds/capacity/step_time.py`` applies).
Bytes per parameter are those a single fused pass must move (the floor for a memory-bound step); peak
extra memory is the resident-set high-water mark of one step over the resident set before it (temporaries
that malloc recycles from earlier steps do not show: a lower bound).
``--device cuda`` (or ``cpu``) measures instead the optimizer-on-the-device regime (ds_configs/zero3.json): torch's fused
Adam alone vs AdmmOptimizer(torch Adam) on that device, eager (penalty into the gradient, then the base's step) and
compiled (kernels/compiled.py: penalty and Adam in one torch.compile'd pass); on ``cpu`` the compiled step is forced
onto the CPU flat (it normally takes the C++ kernels), which rehearses the CUDA rows on a machine without a GPU.
``--threads 1 2 4 ...`` runs the whole measurement once per thread count, each in a fresh process with
OMP_NUM_THREADS = n (read at start by every OpenMP runtime in play: torch's, the fused kernels', DeepSpeedCPUAdam's),
and ends with a table of every ratio per thread count.

    python bench/optimizer_step.py --numel 32e6 --rounds 1 --threads 1 2 4 8 16 --json
    python bench/optimizer_step.py --device cuda --json

With --json the last line holds ratio_fp32, ratio_elsal (ELSA-L as ds_configs/zero3_offload_elsal.json sets it up: its
``elsa.base_optimizer``, named in ``elsal_base_optimizer``), ratio_elsal_minifloat and ratio_elsal_bnb (each code
format; amortized, all against DeepSpeedCPUAdam) and projection_steps_equiv (one projection in DeepSpeedCPUAdam
steps), for the first --numel.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from elsa_ds.admm.optimizer import AdmmOptimizer, AdmmSettings  # noqa: E402
from elsa_ds.admm.projection import Slice  # noqa: E402
from elsa_ds.capacity.optimizer_probe import layer_slices  # noqa: E402 - the probe's flat, cut as here
from elsa_ds.admm.schedule import LambdaSchedule  # noqa: E402
from elsa_ds.admm.state import StateDtype  # noqa: E402
from elsa_ds.zero.ds_config import DsConfig  # noqa: E402

# bytes one pass moves per parameter (read + write): p, g, m, v read, p, m, v written; z, u read on pruned entries
BYTES = {"adam_fp32": 16 + 12, "elsa_fp32": 16 + 12 + 8, "adam_8bit": 10 + 6, "elsa_l": 10 + 6 + 1 + 2}
# a projection (the sampled-bracket path, admm/kernels/select.py): a 1/16 sample and one full pass over x, u, F,
# then the split (x, u, F, z read; z, u written) (8-bit F: one code per entry; ELSA-L's u bf16, z fp8)
PROJECTION_BYTES = {"fp32": 12 / 16 + 12 + 16 + 8, "elsa_l": 7 / 16 + 7 + 8 + 3}


# the authors' remedies (--lmda_schedule adaptive, --relaxation), as AdmmSettings fields
REMEDIES = {"adaptive": {"lmda_schedule": LambdaSchedule.adaptive}, "relaxed": {"relaxation": 1.6}}


class Runner:
    """One optimizer on its own copy of the flat; ``run(steps)`` returns the per-step seconds and projection flags."""

    def __init__(self, name: str, make, flat: torch.Tensor, grad: torch.Tensor, slices: list[Slice] | None, interval: int,
                 dtypes=(StateDtype.fp32, StateDtype.fp32), kernels: bool = True, remedy: dict | None = None):
        self.name, self.grad = name, grad
        self.p = torch.nn.Parameter(flat.clone())
        self.opt = make([self.p])
        self.admm = slices is not None
        if self.admm:
            settings = AdmmSettings(total_steps=1 << 30, interval=interval, lmda=0.01, z_dtype=dtypes[0], u_dtype=dtypes[1],
                                    kernels=kernels, **(remedy or {}))
            self.opt = AdmmOptimizer(self.opt, settings)
            self.opt.assign(self.p, slices)
        self.t = 0

    def one(self) -> tuple[float, bool]:
        self.p.grad = self.grad.clone() if self.p.grad is None else self.p.grad.copy_(self.grad)
        projected = False
        if self.admm:
            self.opt.begin_step(self.t)
            projected = self.opt.projected_this_step
        if self.p.device.type != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.opt.step()
        if self.p.device.type != "cpu":
            torch.cuda.synchronize()
        self.t += 1
        return time.perf_counter() - start, projected

    def run(self, steps: int) -> list[tuple[float, bool]]:
        return [self.one() for _ in range(steps)]


def peak_extra_bytes(runner: Runner) -> int:
    """Resident-set high-water mark of one step minus the resident set before it (Linux; 0 elsewhere): a lower bound."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kb("VmRSS")
        runner.one()
        return max(0, _status_kb("VmHWM") - before) * 1024
    except OSError:
        return 0


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def abba(a: Runner, b: Runner, block: int, rounds: int) -> tuple[list, list]:
    """Blocks of ``block`` steps in the order A B B A, ``rounds`` times; each runner warmed up first."""
    a.run(2)
    b.run(2)
    times = {a.name: [], b.name: []}
    for _ in range(rounds):
        for r in (a, b, b, a):
            times[r.name] += r.run(block)
    return times[a.name], times[b.name]


def summarize(times: list[tuple[float, bool]], interval: int) -> dict:
    plain = [s for s, proj in times if not proj]
    proj = [s for s, p in times if p]
    out = {"step_ms": 1e3 * statistics.median(plain)}
    if proj:
        out["projection_ms"] = 1e3 * max(0.0, statistics.median(proj) - statistics.median(plain))
        out["amortized_ms"] = out["step_ms"] + out["projection_ms"] / interval
    return out


def _makers() -> dict:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    makers = {"deepspeed_adam": lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3)}
    try:
        import bitsandbytes as bnb

        makers["bnb_adam8bit"] = lambda ps: bnb.optim.Adam8bit(ps, lr=1e-3)
    except ImportError:
        print("bitsandbytes is not installed: ELSA-L runs on the fused 8-bit Adam alone")
    from elsa_ds.admm.adam8bit import Adam8bit

    makers["fused_adam8bit"] = lambda ps: Adam8bit(ps, lr=1e-3)
    makers["minifloat_adam8bit"] = lambda ps: Adam8bit(ps, lr=1e-3, format="minifloat")
    return makers


def _pair(res: dict, names: tuple[str, str], runners: tuple[Runner, Runner], args, rounds: int) -> None:
    ta, tb = abba(*runners, args.interval, rounds)
    base_ms = summarize(ta, args.interval)["step_ms"]  # each ratio against the DeepSpeedCPUAdam steps beside it
    for name, times, runner in zip(names, (ta, tb), runners):
        if name not in res:
            res[name] = summarize(times, args.interval)
            res[name]["base_ms"] = base_ms
            res[name]["rss_growth_MiB"] = peak_extra_bytes(runner) / 2**20
            if runner.admm:
                st = runner.opt.state[runner.p]
                res[name]["fused"] = bool(runner.opt._fused.steps(runner.p, st)) and not runner.opt._per_layer  # adaptive: eager
                res[name]["projection_paths"] = dict(runner.opt._fused.projection_paths)  # bracket / missed / exact


def measure(numel: int, args) -> dict:
    """Every pair on one flat of ``numel`` entries; medians in ms."""
    g = torch.Generator().manual_seed(0)
    flat, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 1e-3
    slices = layer_slices(numel, args.slices, 0.5)
    mk, res = _makers(), {}
    low = (StateDtype.fp8, StateDtype.bf16)
    base8 = mk.get("bnb_adam8bit", mk["fused_adam8bit"])
    pairs = [(("deepspeed_adam", "elsa_fp32"), (mk["deepspeed_adam"], None, True), (mk["deepspeed_adam"], slices, True, None)),
             (("deepspeed_adam", "elsa_l_minifloat"), (mk["deepspeed_adam"], None, True),
              (mk["minifloat_adam8bit"], slices, True, low)),
             (("deepspeed_adam", "elsa_l_bnb"), (mk["deepspeed_adam"], None, True), (base8, slices, True, low))]
    if args.eager:
        pairs += [(("deepspeed_adam", "eager_elsa_fp32"), (mk["deepspeed_adam"], None, True), (mk["deepspeed_adam"], slices, False, None)),
                  (("deepspeed_adam", "eager_elsa_l"), (mk["deepspeed_adam"], None, True), (base8, slices, False, low))]
    if args.torch_adam:  # --base_optimizer adam under offload: torch's Adam on the host (the ELSA step on its eager path)
        torch_adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
        pairs += [(("deepspeed_adam", "elsa_torch_adam"), (mk["deepspeed_adam"], None, True), (torch_adam, slices, True, None))]
    if args.remedies:  # kernels on: what each remedy leaves to the eager path (REMEDIES), on each base
        bases = {"fp32": (mk["deepspeed_adam"], None), "l_minifloat": (mk["minifloat_adam8bit"], low), "l_bnb": (base8, low)}
        pairs += [(("deepspeed_adam", f"{name}_{kind}"), (mk["deepspeed_adam"], None, True), (make, slices, True, dtypes))
                  for name in REMEDIES for kind, (make, dtypes) in bases.items()]
    for names, (make_a, _, _), (make_b, sl, on, dtypes) in pairs:
        a = Runner(names[0], make_a, flat, grad, None, args.interval)
        b = Runner(names[1], make_b, flat, grad, sl, args.interval, dtypes or (StateDtype.fp32, StateDtype.fp32), on,
                   REMEDIES.get(names[1].split("_")[0]))
        slow = names[1].startswith("eager") or names[1].split("_")[0] in REMEDIES or names[1] == "elsa_torch_adam"  # one ABBA round
        _pair(res, names, (a, b), args, 1 if slow else args.rounds)
        del a, b
    for name in ("bnb_adam8bit", "fused_adam8bit", "minifloat_adam8bit"):
        if name in mk:
            r = Runner(name, mk[name], flat, grad, None, args.interval)
            r.run(2)
            res[name] = summarize(r.run(4 if name.startswith("bnb") else args.interval), args.interval)
    return res


def measure_device(numel: int, args) -> dict:
    """torch's fused Adam alone vs ELSA on ``args.device``, eager and compiled (ABBA pairs, as above); medians in ms."""
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    flat, grad = torch.randn(numel, generator=g).to(device), (torch.randn(numel, generator=g) * 1e-3).to(device)
    slices = layer_slices(numel, args.slices, 0.5)
    make = lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True)  # noqa: E731
    res = {}
    os.environ["ELSA_DS_COMPILED"] = "1"  # the compiled step is opt-in; ``kernels`` picks it per runner
    for name, kernels in (("elsa_eager", False), ("elsa_compiled", True)):
        a = Runner("torch_adam", make, flat, grad, None, args.interval)
        b = Runner(name, make, flat, grad, slices, args.interval, kernels=kernels)
        b.opt._compiled.cpu = kernels  # on a CPU flat (the rehearsal) the compiled step stands in for the C++ kernels
        ta, tb = abba(a, b, args.interval, args.rounds)
        res.setdefault("torch_adam", summarize(ta, args.interval))
        res[name] = {**summarize(tb, args.interval), "base_ms": summarize(ta, args.interval)["step_ms"],
                     "compiled_x_steps": b.opt._compiled.x_steps, "compiled": b.opt._compiled.compiled}
        del a, b
    return res


def report_device(numel: int, res: dict, device: str) -> dict:
    print(f"\n## {device}: {numel / 1e6:g}M entries\n")
    print("| optimizer | step ms | projection ms | amortized ms | / torch fused Adam beside it | compiled x-steps |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        amortized = r.get("amortized_ms", r["step_ms"])
        print(f"| {name} | {r['step_ms']:.2f} | {r.get('projection_ms', float('nan')):.2f} | {amortized:.2f} | "
              f"{amortized / r.get('base_ms', r['step_ms']):.2f} | {r.get('compiled_x_steps', '')} |")
    eager, comp = res["elsa_eager"], res["elsa_compiled"]
    return {"device": device, "adam_ms": res["torch_adam"]["step_ms"], "ratio_eager": eager["amortized_ms"] / eager["base_ms"],
            "ratio_compiled": comp["amortized_ms"] / comp["base_ms"], "step_ratio_eager": eager["step_ms"] / eager["base_ms"],
            "step_ratio_compiled": comp["step_ms"] / comp["base_ms"], "compiled_x_steps": comp["compiled_x_steps"],
            "compiled": comp["compiled"]}


def per_thread_count(args) -> dict:
    """The measurement once per thread count, each in a fresh process with OMP_NUM_THREADS = n; their JSON lines."""
    child = [sys.executable, str(Path(__file__).resolve()), "--numel", *(str(n) for n in args.numel), "--slices", str(args.slices),
             "--interval", str(args.interval), "--rounds", str(args.rounds), "--json"]
    child += ["--eager"] if args.eager else []
    child += ["--remedies"] if args.remedies else []
    child += ["--device", args.device] if args.device else []
    out = {}
    for n in args.threads:
        print(f"\n# {n} thread(s)", flush=True)
        proc = subprocess.run(child, env={**os.environ, "OMP_NUM_THREADS": str(n)}, capture_output=True, text=True)
        print(proc.stdout, proc.stderr[-2000:] if proc.returncode else "", flush=True)
        if proc.returncode != 0:
            raise SystemExit(f"the {n}-thread run failed with exit code {proc.returncode}")
        out[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = [k for k, v in out[args.threads[0]].items() if isinstance(v, float) and ("ratio" in k or k.endswith("_ms") or "equiv" in k)]
    print("\n| threads | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for n, row in out.items():
        print(f"| {n} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")
    return out


def report(numel: int, res: dict, interval: int) -> dict:
    """Print the table for one size; return its ratios."""
    base = res["deepspeed_adam"]["step_ms"]
    print(f"\n## {numel / 1e6:g}M entries, {interval=}\n")
    print("| optimizer | step ms | projection ms | amortized ms | / DeepSpeedCPUAdam beside it | RSS growth MiB | fused |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        ref = r.get("base_ms", base)
        amortized = r.get("amortized_ms", r["step_ms"])
        print(f"| {name} | {r['step_ms']:.1f} | {r.get('projection_ms', float('nan')):.1f} | {amortized:.1f} | "
              f"{amortized / ref:.2f} | {r.get('rss_growth_MiB', float('nan')):.0f} | {r.get('fused', '')} |")
    fp32, bnb, mini = res["elsa_fp32"], res["elsa_l_bnb"], res["elsa_l_minifloat"]
    shipped = elsal_base_optimizer()
    low = mini if shipped == "adam8bit_minifloat" else bnb
    ratios = {"ratio_fp32": fp32["amortized_ms"] / fp32["base_ms"], "ratio_elsal": low["amortized_ms"] / low["base_ms"],
              "elsal_base_optimizer": shipped, "ratio_elsal_minifloat": mini["amortized_ms"] / mini["base_ms"],
              "ratio_elsal_bnb": bnb["amortized_ms"] / bnb["base_ms"],
              "projection_steps_equiv": fp32["projection_ms"] / fp32["base_ms"],
              "projection_steps_equiv_elsal": low["projection_ms"] / low["base_ms"],
              "projection_steps_equiv_elsal_bnb": bnb["projection_ms"] / bnb["base_ms"], "base_step_ms": base,
              "projection_paths": fp32.get("projection_paths", {})}
    ratios["remedies"] = remedy_factors(res)
    floor_fp32 = (BYTES["elsa_fp32"] + PROJECTION_BYTES["fp32"] / interval) / BYTES["adam_fp32"]
    floor_l = (BYTES["elsa_l"] + PROJECTION_BYTES["elsa_l"] / interval) / BYTES["adam_fp32"]
    print(f"\nbytes per parameter per step: DeepSpeedCPUAdam {BYTES['adam_fp32']}, fused ELSA {BYTES['elsa_fp32']}, "
          f"8-bit Adam {BYTES['adam_8bit']}, fused ELSA-L {BYTES['elsa_l']}; per projection {PROJECTION_BYTES['fp32']} (fp32), "
          f"{PROJECTION_BYTES['elsa_l']} (ELSA-L)")
    print(f"ratio_fp32 {ratios['ratio_fp32']:.2f} (byte floor {floor_fp32:.2f}), ratio_elsal {ratios['ratio_elsal']:.2f} "
          f"({shipped}; byte floor {floor_l:.2f}; minifloat {ratios['ratio_elsal_minifloat']:.2f}, bitsandbytes' codes "
          f"{ratios['ratio_elsal_bnb']:.2f}), projection = {ratios['projection_steps_equiv']:.2f} DeepSpeedCPUAdam steps "
          f"(ELSA-L {ratios['projection_steps_equiv_elsal']:.2f}); achieved DeepSpeedCPUAdam bandwidth "
          f"{BYTES['adam_fp32'] * numel / base / 1e6:.1f} GB/s; projection paths {ratios['projection_paths']}")
    return ratios


def remedy_factors(res: dict) -> dict:
    """Each remedy's step and projection against the fused ELSA's beside the same DeepSpeedCPUAdam (the factors
    ``elsa_ds/capacity/step_time.py`` applies to the fused figures), printed; {} without --remedies."""
    out = {}
    for name in (n for n in res if n.split("_")[0] in REMEDIES):
        fused = res["elsa_" + name.split("_", 1)[1]]  # elsa_fp32, elsa_l_minifloat, elsa_l_bnb
        r = res[name]
        out[name] = {"step_vs_fused": (r["step_ms"] / r["base_ms"]) / (fused["step_ms"] / fused["base_ms"]),
                     "projection_vs_fused": (r["projection_ms"] / r["base_ms"]) / (fused["projection_ms"] / fused["base_ms"])}
        print(f"{name}: step {out[name]['step_vs_fused']:.2f}x, projection {out[name]['projection_vs_fused']:.2f}x the fused ELSA's")
    return out


def elsal_base_optimizer() -> str:
    """The 8-bit base optimizer ELSA-L runs on under CPU offload: the one the shipped zero3_offload_elsal config names."""
    return DsConfig.load("zero3_offload_elsal").raw["elsa"]["base_optimizer"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, nargs="+", default=[32e6])
    ap.add_argument("--slices", type=int, default=8)
    ap.add_argument("--interval", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds of `interval` steps per optimizer")
    ap.add_argument("--eager", action="store_true", help="also the eager reference path (slow)")
    ap.add_argument("--remedies", action="store_true", help="also the adaptive λ and over-relaxation (their eager parts)")
    ap.add_argument("--torch_adam", action="store_true", help="also ELSA on torch's Adam on the host (--base_optimizer adam)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", help="cuda or cpu: the optimizer-on-the-device rows (torch's fused Adam, ELSA eager, compiled)")
    ap.add_argument("--threads", type=int, nargs="+", help="run once per OpenMP thread count, each in a fresh process")
    args = ap.parse_args()
    if args.threads:
        out = per_thread_count(args)
        if args.json:
            print(json.dumps({"threads": out}))
        return 0
    from elsa_ds.admm.kernels import build

    kernels = build.load()
    loop8 = "hand-written AVX-512" if kernels and kernels.has_span8_avx512() else "portable"
    fused = (f"{kernels.simd_level()}, OpenMP threads {kernels.max_threads()}, 8-bit step loop {loop8}" if kernels
             else "unavailable (eager path)")
    print(f"config: {vars(args)}; torch threads {torch.get_num_threads()}; fused kernels {fused}")
    out = {}
    for numel in (int(n) for n in args.numel):
        if args.device:
            out[numel] = report_device(numel, measure_device(numel, args), args.device)
        else:
            out[numel] = report(numel, measure(numel, args), args.interval)
    if args.json:
        first = out[int(args.numel[0])]
        rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in first.items()}
        print(json.dumps({**rounded, "numel": int(args.numel[0]), "slices": args.slices, "interval": args.interval,
                          "torch_threads": torch.get_num_threads(), "omp_threads": kernels.max_threads() if kernels else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
