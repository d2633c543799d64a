"""Sparse decode on a GPU, end to end: each LLaMA-2-7B matrix, then generate() of a whole LLaMA-2-7B-shaped model.

Two parts, each figure beside its dense bf16 counterpart measured in the same process:

* ``matrix``: bench/sparse_decode_gpu.py's per-weight timing (4096x4096 and 11008x4096 at batch 1: a CUDA graph of
  back-to-back calls against dense ``F.linear``, the byte floor from the measured read bandwidth, every
  rows_per_program of the Triton kernel); without CUDA it records why it skipped.
* ``generate``: a LlamaForCausalLM with LLaMA-2-7B's shapes (``--layers`` of its 32; random bf16 weights built on the
  device), its decoder Linear weights magnitude-pruned on the device to each sparsity, the sparse model made from it
  by ``elsa_ds.sparse.sparsify`` (the same SparseLinears ``from_pretrained(..., mode="sparse")`` builds, encoded on
  the GPU instead of read from disk; on CUDA with the static cache generate() compiles into a CUDA graph), then
  ``elsa_ds.sparse.speed.compare_generate``: both models' ``generate()`` as a user calls it, alternating (ABBA) after
  one untimed call each (the compile), tokens/s, the greedy tokens compared. The dense model is the same object
  throughout (its weights restored from a host copy before each cell), so it compiles once per batch size.

Cells run in order of what the issue must show first (90 % at batch 1, then 70 %, 95 %, then batch 8); a cell is
started only while ``--budget_s`` has room for it at the pace of the slowest so far, and the JSON (``--json``) is
rewritten after every cell, so a cut run keeps what it measured. ``--tiny`` shrinks the model (for the rehearsal on a
CPU: no compile there, the same code path otherwise). The last line printed is the JSON of every figure:
``device``, ``matrix_speedup`` ({sparsity: {weight: sparse / dense speed, CUDA graph, batch 1}}),
``generate_speedup`` ({sparsity: sparse / dense tokens/s at batch 1}) and the raw rows beside them; a part or cell that
raises is recorded in ``failed`` (its error and traceback), the rest run on, and the exit status is 1. ``--siblings``: each
cell times the sparse model with a layer's q+k+v and gate+up grouped (elsa_ds/sparse/siblings.py, on CUDA by default)
against the same sparse model with them apart (``siblings_speedup``: grouped / apart tokens/s).

    python bench/gpu_decode.py --json bench/results/gpu_decode.json
    python bench/gpu_decode.py --device cpu --tiny --budget_s 120          # the rehearsal (tests/test_bench_gpu_decode.py)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sparse_decode import LLAMA2_7B as _LLAMA2_7B_LAYER  # noqa: E402 - the CPU bench's shapes

LLAMA2_7B = {**_LLAMA2_7B_LAYER, "num_hidden_layers": 32}
TINY = {"hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "num_hidden_layers": 2}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="where the model is built and timed [cuda]")
    p.add_argument("--layers", type=int, default=None, help="decoder layers [32; --tiny: 2]")
    p.add_argument("--tiny", action="store_true", help="a small Llama instead of LLaMA-2-7B's shapes (the CPU rehearsal)")
    p.add_argument("--sparsities", default="0.9,0.7,0.95", help="the generate cells' sparsities, in order [0.9,0.7,0.95]")
    p.add_argument("--batches", default="1,8", help="generate batch sizes; every sparsity at the first, then the next [1,8]")
    p.add_argument("--steps", type=int, default=64, help="new tokens per generate() [64]")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens [16]")
    p.add_argument("--rounds", type=int, default=3, help="timed generate() calls per model and cell (ABBA) [3]")
    p.add_argument("--compile", action="store_true",
                   help="off CUDA too: a static cache and the compiled decode step, as generate() takes on CUDA by itself")
    p.add_argument("--backend", default="inductor", choices=("inductor", "cudagraphs", "aot_eager"),
                   help="torch.compile's backend for generate()'s decode step, both models [inductor: what a user gets; "
                        "cudagraphs: the same CUDA graph without inductor's code generation, a much shorter first call]")
    p.add_argument("--no_matrix", action="store_true", help="skip the per-matrix part")
    p.add_argument("--siblings", action="store_true",
                   help="each cell times the sparse model with q+k+v and gate+up grouped (one product each: "
                        "elsa_ds/sparse/siblings.py) against the same model with them apart, instead of sparse against dense")
    p.add_argument("--matrix_calls", type=int, default=100, help="per-matrix calls per timed round [100]")
    p.add_argument("--triton_rows", type=int, default=None,
                   help="rows_per_program of the sparse model's Triton kernel [the per-matrix part's fastest at 90 %%, else "
                        "the library's default]")
    p.add_argument("--budget_s", type=float, default=540, help="start no cell that would end past this many seconds [540]")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here (rewritten after every cell)")
    args = p.parse_args(argv)
    try:
        sparsities = [float(v) for v in args.sparsities.split(",")]
        batches = [int(v) for v in args.batches.split(",")]
    except ValueError:
        p.error(f"--sparsities {args.sparsities!r} / --batches {args.batches!r}: comma-separated numbers")
    if not all(0 < v < 1 for v in sparsities) or not all(1 <= b <= 16 for b in batches):
        p.error(f"--sparsities {args.sparsities} must lie in (0, 1) and --batches {args.batches} in 1..16 (the kernels' rows)")
    if min(args.steps, args.prompt, args.rounds, args.layers or 1) < 1:
        p.error("--steps, --prompt, --rounds and --layers take 1 or more")
    return args


def guarded(what: str, fn, *a):
    """``fn(*a)``, or on an exception a record of it (type, message, the traceback's last lines) and None: one failed
    part or cell costs its own figures, not the rest of a GPU call's."""
    try:
        return fn(*a), None
    except Exception as err:  # noqa: BLE001 - recorded and reported; the run goes on
        import traceback

        print(f"{what} failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return None, {"what": what, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}


def environment(device: str) -> dict:
    import torch
    import transformers

    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "transformers": transformers.__version__}
    if torch.device(device).type == "cuda":
        import sparse_decode_gpu

        gpu = sparse_decode_gpu.environment()  # the per-matrix bench's: GPU, its memory, CUDA, triton
        env.update({k: v for k, v in gpu.items() if k not in ("date", "torch")}, device=gpu["gpu"])
    else:
        from sparse_decode import cpu_model

        env.update(device=cpu_model(), threads=torch.get_num_threads())
    return env


def build_model(shape: dict, layers: int, device: str):
    """A LlamaForCausalLM of ``shape`` with ``layers`` decoder layers, bf16, its random weights drawn on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**shape, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def matrix_part(args: argparse.Namespace) -> dict:
    import torch

    import sparse_decode_gpu

    reason = "not a CUDA device" if torch.device(args.device).type != "cuda" else sparse_decode_gpu.skipped()
    if reason is not None:
        return {"skipped": reason}
    matrix_args = sparse_decode_gpu.parse(["--sparsities", "0.7,0.9,0.95", "--batches", "1", "--calls", str(args.matrix_calls),
                                           "--rows", "1,4,8,16"])  # both layouts, default warps: 9 variants a weight
    return sparse_decode_gpu.measure(matrix_args)


def gpu_memory(device: str) -> dict | None:
    import torch

    if torch.device(device).type != "cuda":
        return None
    return {"allocated_gib": torch.cuda.memory_allocated(device) / 2**30, "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}


def generate_rows(matrix: dict, asked: int | None) -> int | None:
    """The Triton kernel's rows_per_program for the generate cells, set for the whole process (ELSA_DS_TRITON_ROWS):
    the one asked for, else the per-matrix part's fastest at 90 % in the layout the sparse model takes on a GPU
    (``ELSA_DS_GPU_LAYOUT``; least CUDA-graph µs summed over the two weights, default warps), else None (the
    library's default)."""
    from elsa_ds.sparse.linear import gpu_layout
    from elsa_ds.sparse.triton_spmv import ROWS_ENV

    prefix = "cols16_r" if gpu_layout() == "cols16" else "triton_r"
    rows = asked
    if rows is None and matrix.get("rows"):
        at90 = [r for r in matrix["rows"] if r["sparsity"] == 0.9 and r["batch"] == 1]
        names = [k for k in at90[0] if k.startswith(prefix) and k.removeprefix(prefix).isdigit()] if at90 else []
        if names:
            best = min(names, key=lambda k: sum(r[k]["graph_us"] for r in at90))
            rows = int(best.removeprefix(prefix))
    if rows is not None:
        os.environ[ROWS_ENV] = str(rows)
    return rows


def cells(sparsities: list[float], batches: list[int]) -> list[tuple[float, int]]:
    """Every sparsity at the first batch size, then at the next: what the issue must show (batch 1) comes first."""
    return [(s, b) for b in batches for s in sparsities]


def generate_cell(dense, originals: dict, sparsity: float, batch: int, args: argparse.Namespace) -> dict:
    """Restore the dense weights, prune them to ``sparsity``, sparsify, and time generate() of both models."""
    import torch

    from sparse_decode import decoder_linears, prune

    from elsa_ds.sparse import SparseLinear, sparsify
    from elsa_ds.sparse.speed import compare_generate, tensor_bytes

    t0 = time.perf_counter()
    linears = decoder_linears(dense)
    with torch.no_grad():
        for name, module in linears.items():
            module.weight.copy_(originals[name], non_blocking=True)  # the same storage: a captured dense graph stays valid
    prune(dense, sparsity)
    pruned_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sparse = sparsify(dense)
    sparsify_s = time.perf_counter() - t0
    reference = dense
    if args.siblings:  # the reference is then the same sparse model with its siblings apart
        reference, sparse = apart_and_grouped(dense, sparse)
        compiled_with(reference, args.backend, everywhere=args.compile)
    compiled_with(sparse, args.backend, everywhere=args.compile)
    dense_weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears.values())
    sparse_weight_bytes = sum(m.weight_bytes for m in sparse.modules() if isinstance(m, SparseLinear))
    from elsa_ds.sparse.siblings import FusedLinear

    row = {"sparsity": sparsity, "batch": batch, "prune_s": pruned_s, "sparsify_s": sparsify_s,
           # q+k+v and gate+up each one launch (elsa_ds/sparse/siblings.py; ELSA_DS_FUSE_SIBLINGS=0 keeps them apart)
           "sibling_groups": sum(isinstance(m, FusedLinear) for m in sparse.modules()),
           "pruned_weight_bytes": {"dense": dense_weight_bytes, "sparse": sparse_weight_bytes},
           "model_tensor_bytes": {"dense": tensor_bytes(dense), "sparse": tensor_bytes(sparse)}}
    row.update(compare_generate(reference, sparse, batch, args.steps, args.rounds, args.prompt))
    if args.siblings:  # "ratio": grouped / apart tokens/s
        row["apart"], row["grouped"] = row.pop("dense"), row.pop("sparse")
    row["gpu_memory"] = gpu_memory(args.device)
    del sparse, reference
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return row


def apart_and_grouped(dense, sparse):
    """(``dense``'s sparse twin with every sibling its own product, ``sparse`` with them grouped)."""
    from elsa_ds.sparse import sparsify
    from elsa_ds.sparse.siblings import FUSE_ENV, fuse_siblings

    before = os.environ.get(FUSE_ENV)
    os.environ[FUSE_ENV] = "0"
    try:
        apart = sparsify(dense)
    finally:
        os.environ.pop(FUSE_ENV) if before is None else os.environ.__setitem__(FUSE_ENV, before)
    fuse_siblings(sparse)  # where sparsify left them apart (off CUDA)
    return apart, sparse


def compiled_with(model, backend: str, everywhere: bool) -> None:
    """generate() with a static cache and its decode step compiled by ``backend`` (transformers compiles it by itself on
    CUDA with inductor's reduce-overhead mode: a CUDA graph of inductor's kernels; ``cudagraphs`` captures the same step
    in a CUDA graph without inductor's code generation), on any device with ``everywhere`` (on a CPU only when asked,
    so that the rehearsal takes the compiled path: no CUDA graph there); inductor on CUDA is left to transformers."""
    from transformers import CompileConfig

    if backend == "inductor" and not everywhere:
        return  # transformers' own default on CUDA, as a user gets it
    # a mode is inductor's alone
    config = CompileConfig(mode="default") if backend == "inductor" else CompileConfig(backend=backend, mode=None)
    config._compile_all_devices = everywhere or None
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = config


def summarize(result: dict) -> None:
    """The issue's keys from the raw rows."""
    matrix = result["matrix"]
    result["matrix_speedup"] = {}
    for row in matrix.get("rows", []):
        if row["batch"] == 1:
            result["matrix_speedup"].setdefault(str(row["sparsity"]), {})[row["weight"]] = row["speedup_graph"]
    rows = result["generate"]
    first_batch = min((r["batch"] for r in rows), default=None)
    speedup = {str(r["sparsity"]): r["ratio"] for r in rows if r["batch"] == first_batch == 1}
    result["siblings_speedup" if result.get("siblings") else "generate_speedup"] = speedup  # grouped / apart, or sparse / dense
    result["generate_same_tokens"] = {f"{r['sparsity']}@{r['batch']}": r["same_tokens"] for r in rows}


def write(result: dict, path: Path | None) -> None:
    summarize(result)
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.perf_counter()
    import torch

    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (run with --device cpu --tiny to rehearse)"}))
        return 0
    from elsa_ds.zero.compat import allow_recompiles

    allow_recompiles(64)  # the dense model per batch size and a sparse model per cell: a user's process compiles one
    shape = TINY if args.tiny else LLAMA2_7B
    layers = args.layers or shape["num_hidden_layers"]
    from elsa_ds.sparse.speed import read_bandwidth

    result: dict = {**environment(args.device), "shape": "tiny" if args.tiny else "llama-2-7b", "layers": layers,
                    "compiled": args.compile or torch.device(args.device).type == "cuda", "compile_backend": args.backend,
                    "siblings": args.siblings,  # the cells: siblings grouped against apart, not sparse against dense
                    "read_bandwidth_gb_s": read_bandwidth(1 << 30 if not args.tiny else 1 << 26, device=args.device) / 1e9,
                    "matrix": {}, "generate": [], "cut": []}
    result["failed"] = []
    if args.no_matrix:
        result["matrix"] = {"skipped": "--no_matrix"}
    else:
        matrix, failure = guarded("the per-matrix part", matrix_part, args)
        result["matrix"] = matrix if failure is None else {"skipped": failure["error"]}
        result["failed"] += [failure] if failure else []
    result["matrix_s"] = time.perf_counter() - start
    result["triton_rows"] = generate_rows(result["matrix"], args.triton_rows)
    from elsa_ds.sparse.linear import gpu_layout

    result["gpu_layout"] = gpu_layout()
    write(result, args.json)
    t0 = time.perf_counter()
    dense = build_model(shape, layers, args.device)
    from sparse_decode import decoder_linears

    originals = {n: m.weight.detach().to("cpu", copy=True) for n, m in decoder_linears(dense).items()}
    compiled_with(dense, args.backend, everywhere=args.compile)
    result["build_s"] = time.perf_counter() - t0
    print(f"model built in {result['build_s']:.1f} s: {layers} layers, {sum(p.numel() for p in dense.parameters()) / 1e9:.2f}B "
          "parameters", file=sys.stderr, flush=True)
    slowest = 0.0
    for sparsity, batch in cells([float(s) for s in args.sparsities.split(",")], [int(b) for b in args.batches.split(",")]):
        left = args.budget_s - (time.perf_counter() - start)
        if slowest > left:
            result["cut"].append({"sparsity": sparsity, "batch": batch, "why": f"{left:.0f} s left, a cell took {slowest:.0f} s"})
            continue
        t0 = time.perf_counter()
        row, failure = guarded(f"the {sparsity:.0%} batch {batch} cell", generate_cell, dense, originals, sparsity, batch, args)
        if failure is not None:
            result["failed"].append({**failure, "sparsity": sparsity, "batch": batch})
            write(result, args.json)
            continue
        row["cell_s"] = time.perf_counter() - t0
        slowest = max(slowest, row["cell_s"])
        result["generate"].append(row)
        a, b = ("apart", "grouped") if args.siblings else ("dense", "sparse")
        print(f"{sparsity:.0%} batch {batch}: {b} / {a} generate() {row['ratio']:.2f}x ({row['ratio_min']:.2f}-"
              f"{row['ratio_max']:.2f}), {a} {row[a]['tokens_per_s']:.1f} tok/s, {b} {row[b]['tokens_per_s']:.1f}; "
              f"same tokens {row['same_tokens']} ({row['equal_token_fraction']:.0%}); first calls {row[a]['first_call_s']:.1f} / "
              f"{row[b]['first_call_s']:.1f} s; cell {row['cell_s']:.0f} s", file=sys.stderr, flush=True)
        write(result, args.json)
    result["seconds"] = time.perf_counter() - start
    write(result, args.json)
    print(json.dumps(result))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
