"""Sparse checkpoint size and decode speed at LLaMA-2-7B's layer shapes, dense against sparse in one process.

A LlamaForCausalLM with LLaMA-2-7B's layer shapes (hidden 4096, MLP 11008, 32 heads; vocabulary 32000) and a few
decoder layers, random bf16 weights, its decoder Linear weights magnitude-pruned per tensor to each sparsity in turn
(nested masks); at each sparsity the dense bf16 export (save_pretrained) is compressed with elsa_ds.sparse.compress
and timed with elsa_ds.sparse.speed: decode steps at batch 1 and 8, dense mode and sparse mode alternating, the byte
floor beside each figure. Speed depends on the pattern, not the values, so random weights are enough.

    python bench/sparse_decode.py                       # 2 layers; bytes at 50/70/90/95 %, decode timed at 70/90/95 %
    python bench/sparse_decode.py --layers 1 --json bench/results/sparse_decode.json --markdown bench/results/sparse_decode.md
    python bench/sparse_decode.py --kernels_only        # one 11008 x 4096 weight: dense F.linear, C++ kernel, torch CSR

``--threads`` sets OMP_NUM_THREADS before torch starts (the C++ kernel and torch share that OpenMP runtime);
``--omp_wait_policy passive`` stops idle OpenMP threads spinning (on a loaded box they take the busy thread's core).
The last line printed is the JSON of every figure.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA2_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2, help="decoder layers [2]")
    p.add_argument("--sparsities", default="0.5,0.7,0.9,0.95", help="comma-separated, rising [0.5,0.7,0.9,0.95]")
    p.add_argument("--decode_at", default="0.7,0.9,0.95", help="sparsities whose decode is timed (bytes: all) [0.7,0.9,0.95]")
    p.add_argument("--batches", default="1,8", help="decode batch sizes [1,8]")
    p.add_argument("--steps", type=int, default=6, help="decode steps per timed round [6]")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per batch size (ABBA) [3]")
    p.add_argument("--with_head", action="store_true", help="also time the whole model (LM head included) [decoder layers only]")
    p.add_argument("--kernels_only", action="store_true", help="only time one 11008x4096 weight: dense, C++ kernel, torch CSR")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for torch and the kernel [1]")
    p.add_argument("--omp_wait_policy", choices=("active", "passive"), default=None,
                   help="OMP_WAIT_POLICY before torch starts: passive stops idle threads spinning on a loaded box [the runtime's]")
    p.add_argument("--vocab", type=int, default=LLAMA2_7B["vocab_size"], help="vocabulary size [32000]")
    p.add_argument("--workdir", type=Path, default=None, help="where the exports go (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    return p.parse_args(argv)


def build_model(layers: int, vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA2_7B, "vocab_size": vocab}, num_hidden_layers=layers, dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def decoder_linears(model) -> dict:
    """The decoder layers' Linear modules by name: what the benches prune."""
    import torch

    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}


def prune(model, sparsity: float) -> None:
    """Magnitude-prune every decoder Linear weight to ``sparsity`` (per tensor; masks nest as sparsity rises)."""
    for module in decoder_linears(model).values():
        prune_weight(module.weight, sparsity)


def prune_weight(w, sparsity: float) -> None:
    """Zero the ``sparsity`` fraction of smallest |w|: bf16 has many equal magnitudes, so a fixed relative jitter far
    below bf16's spacing (1e-4 against 2^-8) breaks the ties and the count is exact; the same jitter every call (drawn on
    w's device: a GPU's stream differs from the CPU's)."""
    import torch

    with torch.no_grad():
        gen = torch.Generator(device=w.device).manual_seed(0)
        score = w.abs().float().flatten() * (1 + 1e-4 * torch.rand(w.numel(), generator=gen, device=w.device))
        threshold = score.kthvalue(int(w.numel() * sparsity)).values
        w.view(-1).masked_fill_(score <= threshold, 0)


def one_sparsity(model, sparsity: float, work: Path, args, bandwidth: float) -> dict:
    from elsa_ds.sparse import compress
    from elsa_ds.sparse.folder import is_weight_file
    from elsa_ds.sparse.speed import disk_bytes, measure

    prune(model, sparsity)
    dense_dir, sparse_dir = work / f"dense_{sparsity}", work / f"sparse_{sparsity}"
    model.save_pretrained(dense_dir)
    dense_files = sum(f.stat().st_size for f in dense_dir.iterdir() if is_weight_file(f))
    print(f"{sparsity:.0%}: dense export written, compressing", file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = compress(dense_dir, sparse_dir, overwrite=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(dense_dir)
    batches = tuple(int(b) for b in args.batches.split(","))
    nonzeros = sum(t["nonzeros"] for t in done["tensors"].values())
    row = {"sparsity": sparsity, "measured_sparsity": 1 - nonzeros / sum(math.prod(t["shape"]) for t in done["tensors"].values()),
           "compress_s": seconds, "dense_files_bytes": dense_files,
           "encodings": sorted({t["encoding"] for t in done["tensors"].values()})}
    row["disk"] = disk_bytes(sparse_dir)
    timed = sparsity in [float(x) for x in args.decode_at.split(",")]
    for part, layers_only in (("layers", True), ("model", False))[: (2 if args.with_head else 1) if timed else 0]:
        row[part] = measure(sparse_dir, batches, args.steps, args.rounds, layers_only=layers_only, bandwidth=bandwidth)
        print(f"{sparsity:.0%} {part}: {[round(d['ratio'], 2) for d in row[part]['decode']]}", file=sys.stderr, flush=True)
    shutil.rmtree(sparse_dir)
    return row


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (the vendor decides batch 1's loop), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_rows(sparsities: list[float], batches: tuple[int, ...], repeats: int = 7) -> list[dict]:
    """One MLP up-projection weight (11008 x 4096, bf16), pruned to each sparsity: ms per matmul, median of ``repeats``
    (dense F.linear, SparseLinear's C++ delta8 kernel, torch CSR with fp32 values, and where the AVX-512 gather loop is
    built the kernel's two batch-1 loops called directly). Each call starts after 128 MB of other traffic, so the weight
    comes from DRAM as in a real decode step (the other layers' weights pass between two calls of one layer); the
    order rotates every repeat. (In a fixed order a sparse path run after another found the weight in L3: up to ~15 %
    flattering, seen on 2026-11-27.)"""
    import statistics

    import torch

    from elsa_ds.sparse import kernels
    from elsa_ds.sparse.linear import SparseLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(4096, 11008, bias=False).to(torch.bfloat16)
    flush = torch.zeros(128 << 20, dtype=torch.uint8)
    rows = []
    for sparsity in sparsities:
        prune_weight(linear.weight, sparsity)
        paths = {"dense": linear, "kernel": SparseLinear.from_dense(linear, "kernel"), "csr": SparseLinear.from_dense(linear, "csr")}
        built, sl = kernels.load(), paths["kernel"]
        if getattr(built, "avx512", False):  # batch 1's two loops where both are built, whichever SparseLinear takes
            for name, plain in (("avx512", False), ("portable", True)):
                paths[name] = lambda x, sl=sl, plain=plain: kernels.kernel_matmul(built, sl.parts, x, sl.out_features, plain)
        for batch in batches:
            x = torch.randn(batch, 4096).to(torch.bfloat16)
            times: dict[str, list[float]] = {name: [] for name in paths}
            names = list(paths)
            with torch.no_grad():
                for i in range(repeats + 1):
                    for name in names[i % len(names):] + names[:i % len(names)]:
                        module = paths[name]
                        flush.add_(1)
                        start = time.perf_counter()
                        module(x)
                        times[name].append(time.perf_counter() - start)
            rows.append({"sparsity": sparsity, "batch": batch, **{f"{n}_ms": 1e3 * statistics.median(t[1:]) for n, t in times.items()}})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| sparsity | pruned layers bytes vs dense bf16 | whole model | part | batch | dense tok/s (floor) | "
             "sparse tok/s (floor) | sparse/dense (min-max) | logits rel err |", "|" + "---|" * 9]
    for r in rows:
        disk = r["disk"]
        if "layers" not in r:
            lines.append(f"| {r['sparsity']:.0%} | {disk['pruned_sparse'] / disk['pruned_dense']:.3f}x | "
                         f"{disk['sparse_files'] / r['dense_files_bytes']:.3f}x | (not timed) | | | | | |")
        for part in [p for p in ("layers", "model") if p in r]:
            for d in r[part]["decode"]:
                lines.append(
                    f"| {r['sparsity']:.0%} | {disk['pruned_sparse'] / disk['pruned_dense']:.3f}x | "
                    f"{disk['sparse_files'] / r['dense_files_bytes']:.3f}x | {part} | {d['batch']} | "
                    f"{d['dense']['tokens_per_s']:.2f} ({d['dense']['floor_tokens_per_s']:.1f}) | "
                    f"{d['sparse']['tokens_per_s']:.2f} ({d['sparse']['floor_tokens_per_s']:.1f}) | "
                    f"{d['ratio']:.2f}x ({d['ratio_min']:.2f}-{d['ratio_max']:.2f}) | {r[part]['logits_max_rel_err']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    import torch

    from elsa_ds.sparse import kernels
    from elsa_ds.sparse.speed import read_bandwidth

    torch.set_num_threads(args.threads)
    if kernels.load() is None:
        print("the C++ decode kernel is not available: sparse mode runs torch CSR", file=sys.stderr)
    sparsities = [float(s) for s in args.sparsities.split(",")]
    kernels_timed = kernel_rows(sparsities, tuple(int(b) for b in args.batches.split(",")))
    nan = float("nan")
    portable_at_1 = kernels.prefer_portable() or not getattr(kernels.load(), "avx512", False)
    ktext = "\n".join([f"| sparsity | batch | dense F.linear ms | C++ delta8 kernel ms (SparseLinear; batch 1 "
                       f"{'portable' if portable_at_1 else 'AVX-512'}) | batch 1's AVX-512 gather loop ms | "
                       "the portable loop ms | torch CSR ms |", "|---|---|---|---|---|---|---|"] + [
        f"| {k['sparsity']:.0%} | {k['batch']} | {k['dense_ms']:.2f} | {k['kernel_ms']:.2f} | "
        f"{k.get('avx512_ms', nan):.2f} | {k.get('portable_ms', nan):.2f} | {k['csr_ms']:.2f} |" for k in kernels_timed])
    print(ktext)
    if args.kernels_only:
        result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
                  "threads": args.threads, "portable_at_batch_1": portable_at_1, "kernels": kernels_timed}
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(result))
        return 0
    work = args.workdir or Path(tempfile.mkdtemp(prefix="sparse_decode_"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.layers, args.vocab)
    bandwidth = read_bandwidth()
    rows = [one_sparsity(model, s, work, args, bandwidth) for s in sparsities]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{cpu_model()}, "
              f"{os.cpu_count()} CPUs", "threads": args.threads,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load_average": os.getloadavg(), "layers": args.layers,
              "shapes": "LLaMA-2-7B (4096/11008)", "dtype": "bfloat16", "read_bandwidth_gb_s": bandwidth / 1e9,
              "kernels": kernels_timed, "rows": rows}
    text = ktext + "\n\n" + table(rows)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
