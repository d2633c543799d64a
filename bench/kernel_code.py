"""The Triton decode kernels' machine code for an H100/H200 (sm_90), read without a GPU: instructions an entry, registers.

Each kernel variant is compiled by Triton for sm_90 (its bundled ptxas) and disassembled (its bundled nvdisasm and
cuobjdump): the SASS instructions of its main loop (the longest backward branch), divided by the entries a thread
handles per trip, give the instructions an entry costs; beside them the registers, the stack (spills) and the shared
memory per program. At batch 1 a decode matmul's entries cost these instructions on every SM's four schedulers:
``issue_us_h200`` is the time the instructions alone take at the H200's issue rate (132 SMs x 4 warp-instructions a
clock at 1.98 GHz, 32 lanes each) for LLaMA-2-7B's 11008x4096 MLP weight at ``--sparsity``, beside the bytes' floor at
``--bandwidth`` (the H200's measured 3.9 TB/s): a kernel whose instructions outlast its bytes is not bandwidth-bound.
An estimate from the code, not a timing: bench/sparse_decode_gpu.py times the same variants on a GPU.

    python bench/kernel_code.py --json bench/results/kernel_code_sm90.json
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ISSUE_PER_S_H200 = 132 * 4 * 1.98e9 * 32  # thread-instructions a second: SMs x schedulers x clock x lanes
MLP = (11008, 4096)
# (name, layout, rows_per_program, num_warps, rows of x in a program): the 1-row delta8 kernel timed on the H200 on
# 2026-11-27, the row-group kernels on both layouts at the tile sizes delta8_linear picks for ~410 entries a row (90 %
# of 4096), then the cols16 kernel holding the batch in its program (delta8_linear's choice for 2 to 16 rows of x)
VARIANTS = [("delta8_r1", "delta8", 1, 2, 1), ("delta8_r4", "delta8", 4, 4, 1), ("delta8_r8", "delta8", 8, 4, 1),
            ("delta8_r16", "delta8", 16, 4, 1), ("cols16_r1", "cols16", 1, 2, 1), ("cols16_r4", "cols16", 4, 4, 1),
            ("cols16_r8", "cols16", 8, 4, 1), ("cols16_r16", "cols16", 16, 4, 1), ("cols16_r16w1", "cols16", 16, 1, 1),
            ("cols16_r4_b2", "cols16", 4, 4, 2), ("cols16_r1_b8", "cols16", 1, 4, 8), ("cols16_r4_b8", "cols16", 4, 4, 8),
            ("cols16_r8_b8", "cols16", 8, 4, 8), ("cols16_r4_b16", "cols16", 4, 4, 16)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sparsity", type=float, default=0.9, help="of the MLP weight the issue time is for [0.9]")
    p.add_argument("--bandwidth", type=float, default=3.9e12, help="bytes/s of the byte floor [3.9e12: the H200's, measured]")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p.parse_args(argv)


def tools() -> Path:
    """The folder of Triton's bundled CUDA binaries (ptxas, nvdisasm, cuobjdump)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_variant(layout: str, rows: int, warps: int, entries_per_row: int, batch: int = 1) -> tuple[bytes, int, int]:
    """The sm_90 cubin of one variant in bf16 (``batch`` > 1: cols16 with that many rows of x in a program), its block
    (entries a row a trip) and its entries a thread a trip (each for every row of x the program holds)."""
    from elsa_ds.sparse import triton_spmv as T

    if layout == "delta8" and rows == 1:
        block = T.block_sizes(1, entries_per_row)[1]
    else:
        block = T.tile_block(rows * batch, entries_per_row)
    compiled = T.compile_ahead(layout, rows, "bf16", block, num_warps=warps, block_b=batch)
    return compiled.asm["cubin"], block, block * rows // (32 * warps)


def loop_instructions(sass: str) -> int:
    """SASS instructions of the longest loop: from a label to the last backward branch that jumps to it."""
    lines = sass.splitlines()
    at = {i for i, line in enumerate(lines) if re.search(r"/\*[0-9a-f]{4}\*/", line)}
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    longest = 0
    for i in sorted(at):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", lines[i])
        if m and labels.get(m.group(1), i) < i:
            longest = max(longest, sum(1 for j in at if labels[m.group(1)] < j <= i))
    return longest


def read_code(cubin: bytes, work: Path) -> dict:
    """Loop instructions, registers, stack and shared memory of a cubin."""
    path = work / "kernel.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([str(tools() / "nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([str(tools() / "cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                           check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", usage))
    return {"loop_instructions": loop_instructions(sass), "registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]),
            "shared_bytes": int(fields["SHARED"])}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch

    from bench.sparse_decode import prune_weight
    from elsa_ds.sparse.format import delta8_to_cols16, encode_delta8

    args = parse(argv)
    weight = torch.randn(*MLP).to(torch.bfloat16)
    prune_weight(weight, args.sparsity)
    delta8 = encode_delta8(weight)
    layouts = {"delta8": delta8, "cols16": delta8_to_cols16(delta8, MLP)}
    entries = {k: v["values"].numel() for k, v in layouts.items()}
    nbytes = {k: sum(t.numel() * t.element_size() for t in v.values()) for k, v in layouts.items()}
    result: dict = {"target": "sm_90", "sparsity": args.sparsity, "weight": "x".join(map(str, MLP)), "entries": entries,
                    "bytes": nbytes, "byte_floor_us": {k: b / args.bandwidth * 1e6 for k, b in nbytes.items()}, "variants": []}
    print("| variant | rows of x a program | block | entries/thread/trip | loop SASS | SASS/entry | registers | stack B | "
          "issue µs (MLP, that many rows of x) | byte floor µs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout, rows, warps, batch in VARIANTS:
            cubin, block, per_thread = compile_variant(layout, rows, warps, round(entries[layout] / MLP[0]), batch)
            code = read_code(cubin, Path(tmp))
            per_entry = code["loop_instructions"] / per_thread  # for every row of x the program holds
            row = {"name": name, "layout": layout, "rows_per_program": rows, "num_warps": warps, "batch_in_program": batch,
                   "block": block, "entries_per_thread_per_trip": per_thread, **code, "instructions_per_entry": per_entry,
                   "issue_us_h200": entries[layout] * per_entry / ISSUE_PER_S_H200 * 1e6}
            result["variants"].append(row)
            print(f"| {name} | {batch} | {block} | {per_thread} | {code['loop_instructions']} | {per_entry:.1f} | "
                  f"{code['registers']} | {code['stack_bytes']} | {row['issue_us_h200']:.1f} | "
                  f"{result['byte_floor_us'][layout]:.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
