"""Decode on CUDA at LLaMA-2-7B's layer shapes: dense bf16 F.linear against the Triton kernels, one weight at a time.

Each weight (4096 x 4096 attention, 11008 x 4096 MLP; random bf16, magnitude-pruned, masks nested as sparsity rises)
is timed in both GPU layouts (``triton_r*``: delta8's kernels; ``cols16_r*``: the cols16 layout's, columns whole, past
one row of x the batch in one program; ``cols16each_r*``: a program per row of x there),
each at every ``--rows`` (and ``--warps``), at batch 1 (``--batches``) two ways: ``graph``, a CUDA graph of
back-to-back calls timed by CUDA events (the GPU's time per call, no launch overhead), and ``eager``, the same calls
launched from Python (what an un-captured decode loop pays). The calls cycle through enough copies of the weight
(``--min_mb`` in all) that it is read from HBM, not from L2. The byte floor is the bytes a call must read (weight
parts and x) over the read bandwidth a 1 GiB sum measures on the same GPU. The last line printed is the JSON of
every figure; without CUDA (or triton) the script prints why and a JSON line with ``skipped`` and exits 0
(bench/device/check.sh --dry-run runs it so).

    python bench/sparse_decode_gpu.py
    python bench/sparse_decode_gpu.py --sparsities 0.7,0.9,0.95 --batches 1,8 --json bench/results/sparse_decode_gpu.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sparse_decode import prune_weight  # noqa: E402 - the CPU bench's pruning: same masks

SHAPES = {"attn 4096x4096": (4096, 4096), "mlp 11008x4096": (11008, 4096)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sparsities", default="0.7,0.9,0.95", help="comma-separated, rising [0.7,0.9,0.95]")
    p.add_argument("--batches", default="1", help="decode rows per call [1]")
    p.add_argument("--calls", type=int, default=200, help="calls per timed round [200]")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, median reported [5]")
    p.add_argument("--min_mb", type=float, default=256, help="bytes the weight copies span, so calls read HBM, not L2 [256]")
    p.add_argument("--rows", default="1,4,8,16,32", help="rows_per_program of the Triton kernel, each timed [1,4,8,16,32]")
    p.add_argument("--warps", default="0", help="num_warps of the Triton kernel, each timed with every --rows; 0: its default [0]")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p.parse_args(argv)


def read_bandwidth() -> float:
    """Bytes per second a 1 GiB bf16 sum reads (median of 5)."""
    src = torch.ones(1 << 29, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        src.sum(dtype=torch.float32)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() * src.element_size() / statistics.median(times[1:])


def time_calls(calls: list, rounds: int) -> dict[str, float]:
    """Microseconds per call: CUDA-graph replay (GPU time) and eager launches (wall), medians over ``rounds``."""
    for fn in calls[:3]:
        fn()  # compile / warm up before capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph_us, eager_us = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        graph_us.append(start.elapsed_time(end) * 1e3 / len(calls))
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        torch.cuda.synchronize()
        eager_us.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return {"graph_us": statistics.median(graph_us), "eager_us": statistics.median(eager_us)}


def variants(weight: torch.Tensor, batch: int, args, device: str = "cuda") -> tuple[dict, dict]:
    """The calls to time for one pruned weight: dense ``F.linear`` and every layout x rows x warps of the Triton kernels,
    each over enough copies of its bytes to come from HBM, with the first call's error against dense. Returns
    ({name: (bytes read, [calls])}, the row's sizes and errors). ``device`` cpu runs the kernels under
    TRITON_INTERPRET=1 (tests/test_bench_gpu_decode.py rehearses this so)."""
    from elsa_ds.sparse import triton_spmv
    from elsa_ds.sparse.format import delta8_to_cols16, encode_delta8

    out_f, in_f = weight.shape
    parts = {k: v.to(device) for k, v in encode_delta8(weight).items()}
    layouts = {"triton": parts, "cols16": delta8_to_cols16(parts, (out_f, in_f))}  # the delta8 kernels; the GPU layout's
    # cols16 past one row of x holds the batch in its program by default; cols16each: a program per row of x, beside it
    batch_in_program = {"triton": None, "cols16": None, "cols16each": False}
    if batch > 1:
        layouts["cols16each"] = layouts["cols16"]
    dense = weight.to(device)
    x = torch.randn(batch, in_f, device=device).to(torch.bfloat16)
    y_dense = F.linear(x.float(), dense.float())
    nbytes_of = {name: sum(t.numel() * t.element_size() for t in p.values()) for name, p in layouts.items()}
    row = {"batch": batch, "entries": parts["values"].numel(), "dense_bytes": dense.numel() * dense.element_size(),
           "sparse_bytes": nbytes_of["triton"], "cols16_bytes": nbytes_of["cols16"], "x_bytes": x.numel() * x.element_size()}

    def error(y: torch.Tensor) -> float:
        return float((y.float() - y_dense).abs().max() / y_dense.abs().max())

    def copies(nbytes: int) -> int:
        return max(1, min(256, math.ceil(args.min_mb * 2**20 / nbytes)))

    dense_copies = [dense.clone() for _ in range(copies(row["dense_bytes"]))]
    timed = {"dense": (row["dense_bytes"], [lambda w=w: F.linear(x, w) for w in dense_copies])}
    row["dense_max_rel_err"] = error(F.linear(x, dense))
    for layout, lparts in layouts.items():
        for r in (int(v) for v in args.rows.split(",")):
            for w in (int(v) for v in args.warps.split(",")):
                name = f"{layout}_r{r}" + (f"w{w}" if w else "")
                ws = [{k: v.clone() for k, v in lparts.items()} for _ in range(copies(nbytes_of[layout]))]
                timed[name] = (nbytes_of[layout], [lambda p=p, r=r, w=w, b=batch_in_program[layout]: triton_spmv.delta8_linear(
                    p, x, out_f, rows_per_program=r, num_warps=w or None, batch_in_program=b) for p in ws])
                row[f"{name}_max_rel_err_vs_dense"] = error(timed[name][1][0]())
    row["max_rel_err_vs_dense"] = max(v for k, v in row.items() if k.endswith("_max_rel_err_vs_dense"))  # the worst variant's
    return timed, row


def one_weight(weight: torch.Tensor, batch: int, args, bandwidth: float) -> dict:
    """Dense F.linear and the Triton kernels on copies of one pruned bf16 weight (on the GPU): times, bytes, floors."""
    timed, row = variants(weight, batch, args)
    for name, (nbytes, calls) in timed.items():
        times = time_calls([calls[i % len(calls)] for i in range(args.calls)], args.rounds)
        floor_us = (nbytes + row["x_bytes"]) / bandwidth * 1e6
        row[name] = {**times, "copies": len(calls), "floor_us": floor_us, "graph_gb_s": (nbytes + row["x_bytes"]) / times["graph_us"] / 1e3}
    del timed
    pick_best(row)
    return row


def pick_best(row: dict) -> None:
    """The fastest sparse variant in a CUDA graph: its times as ``triton``, its name, layout, rows and warps, and its
    speed-up over dense (graph and eager)."""
    best = min((k for k in row if k.startswith(("triton_r", "cols16_r", "cols16each_r")) and isinstance(row[k], dict)),
               key=lambda k: row[k]["graph_us"])
    layout, _, variant = best.partition("_r")
    rows_text, _, warps_text = variant.partition("w")
    row["triton"], row["best_variant"], row["best_layout"] = row[best], best, "delta8" if layout == "triton" else layout
    row["best_rows_per_program"], row["best_num_warps"] = int(rows_text), int(warps_text or 0)
    row["speedup_graph"] = row["dense"]["graph_us"] / row["triton"]["graph_us"]
    row["speedup_eager"] = row["dense"]["eager_us"] / row["triton"]["eager_us"]


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__}


def skipped() -> str | None:
    """Why the kernel cannot be timed here (no CUDA, no triton), None when it can."""
    from elsa_ds.sparse import triton_spmv

    return triton_spmv.unavailable("cuda")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    reason = skipped()
    if reason is not None:
        print(f"skipped: {reason}", file=sys.stderr)
        print(json.dumps({"skipped": reason}))
        return 0
    result = measure(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result))
    return 0


def measure(args: argparse.Namespace) -> dict:
    """Every weight, sparsity and batch of ``args``: the table printed row by row, the figures returned."""
    result = {**environment(), "read_bandwidth_gb_s": read_bandwidth() / 1e9, "dtype": "bfloat16", "rows": []}
    bandwidth = result["read_bandwidth_gb_s"] * 1e9
    print("| weight | sparsity | batch | dense us (floor) | best sparse us (floor; its variant) | speedup graph | eager dense / sparse us "
          "| rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for label, (out_f, in_f) in SHAPES.items():
        torch.manual_seed(0)
        weight = torch.randn(out_f, in_f).to(torch.bfloat16)
        for sparsity in (float(s) for s in args.sparsities.split(",")):
            prune_weight(weight, sparsity)
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"weight": label, "sparsity": sparsity, **one_weight(weight, batch, args, bandwidth)}
                result["rows"].append(row)
                d, t = row["dense"], row["triton"]
                print(f"| {label} | {sparsity:.0%} | {batch} | {d['graph_us']:.1f} ({d['floor_us']:.1f}) | "
                      f"{t['graph_us']:.1f} ({t['floor_us']:.1f}; {row['best_variant']}) | {row['speedup_graph']:.2f}x | "
                      f"{d['eager_us']:.1f} / {t['eager_us']:.1f} | {row['max_rel_err_vs_dense']:.1e} |", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
