"""The next-token loss's forward and backward on logits of Gemma's vocabulary: torch's chunks against the Triton kernel.

Both paths of ``elsa_ds.loss.next_token_loss`` (``ELSA_DS_LOSS=chunked`` and the default, which on CUDA is the kernel
of elsa_ds/loss_kernel.py) on the same random bf16 logits [batch, seqlen, vocab], alternating, each timed as loss +
backward (CUDA events on a GPU, wall time on a CPU; median of ``--rounds``), with the kernel's byte floor beside it (it
reads each logit twice and writes its gradient once) and the GPU memory each path allocated beyond the logits. The
evaluation's ``token_nll`` (forward only) the same way. Without CUDA or triton only the chunks run, and the line says
why. The last line printed is the JSON of every figure.

    python bench/loss_speed.py                                  # Gemma-3 270M's plain-loop cells: 32 x 512 tokens
    python bench/loss_speed.py --batch 8 --json bench/results/loss_speed_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elsa_ds import loss as L  # noqa: E402
from elsa_ds.evaluation.perplexity import token_nll  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32, help="sequences [32]")
    p.add_argument("--seqlen", type=int, default=512, help="tokens a sequence [512]")
    p.add_argument("--vocab", type=int, default=262_144, help="logits a token [262144: Gemma's]")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds a path, median reported [5]")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="[cuda where there is one]")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p.parse_args(argv)


def timed(fn, cuda: bool) -> float:
    """Seconds of one call of ``fn`` (CUDA events on a GPU)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(args: argparse.Namespace) -> dict:
    gen = torch.Generator(device=args.device).manual_seed(0)
    logits = (4 * torch.randn(args.batch, args.seqlen, args.vocab, generator=gen, device=args.device)).to(torch.bfloat16)
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=gen, device=args.device)

    values: dict[str, float] = {}  # each path's loss on these logits: the kernel at this size against the chunks

    def train():
        x = logits.detach().requires_grad_()
        loss = L.next_token_loss(x, ids)
        loss.backward()
        values[os.environ[L.LOSS_ENV]] = float(loss.detach())

    paths = {"chunked": "chunked", "fused": "auto"}
    cuda = logits.device.type == "cuda"
    fused_reason = L.fused_disagrees(str(logits.device), torch.bfloat16) if cuda else "not a CUDA device"
    if fused_reason is not None:
        del paths["fused"]
    times: dict[str, dict[str, list[float]]] = {p: {"train": [], "eval": []} for p in paths}
    peak: dict[str, float] = {}
    before = os.environ.get(L.LOSS_ENV)
    for r in range(args.rounds + 1):  # round 0: warm-up (the kernel's compile, the allocator)
        for name, choice in paths.items():
            os.environ[L.LOSS_ENV] = choice
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t_train, t_eval = timed(train, cuda), timed(lambda: token_nll(logits, ids), cuda)
            if cuda:
                peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
            if r:
                times[name]["train"].append(t_train)
                times[name]["eval"].append(t_eval)
    if before is None:
        os.environ.pop(L.LOSS_ENV, None)
    else:
        os.environ[L.LOSS_ENV] = before
    floor_bytes = 3 * logits.numel() * logits.element_size()  # read twice, gradient written once
    out = {"device": torch.cuda.get_device_name(logits.device) if cuda else "cpu", "torch": torch.__version__,
           "shape": [args.batch, args.seqlen, args.vocab], "dtype": "bfloat16", "fused_unavailable": fused_reason,
           "fused_bytes": floor_bytes}
    for name in paths:
        out[name] = {"train_s": statistics.median(times[name]["train"]), "eval_s": statistics.median(times[name]["eval"]),
                     "peak_gib_beyond_logits": peak.get(name)}
        out[name]["train_gb_s"] = floor_bytes / out[name]["train_s"] / 1e9
    if "fused" in paths:
        out["loss_rel_diff"] = abs(values["auto"] - values["chunked"]) / abs(values["chunked"])
        out["train_speedup"] = out["chunked"]["train_s"] / out["fused"]["train_s"]
        out["eval_speedup"] = out["chunked"]["eval_s"] / out["fused"]["eval_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = measure(args)
    for name in ("chunked", "fused"):
        if name in out:
            r = out[name]
            print(f"{name:8s} loss + backward {1e3 * r['train_s']:9.2f} ms ({r['train_gb_s']:.0f} GB/s of the kernel's "
                  f"bytes)  evaluation {1e3 * r['eval_s']:9.2f} ms  peak beyond the logits {r['peak_gib_beyond_logits']}")
    if out["fused_unavailable"]:
        print(f"fused: not run ({out['fused_unavailable']})")
    else:
        print(f"fused / chunked: {out['train_speedup']:.1f}x loss + backward, {out['eval_speedup']:.1f}x evaluation; "
              f"the losses {out['loss_rel_diff']:.2g} apart (relative)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
