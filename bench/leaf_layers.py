"""ZeRO-3's hooks in a small model's step: the same ELSA job with and without ``--leaf_layers``, alternating (ABBA).

    python bench/leaf_layers.py                    # Gemma-3's layer (q/k norms, 4 norms, 7 projections) 64 wide, 18 layers
    python bench/leaf_layers.py --rounds 3 --json  # the last line: one JSON object
    python bench/leaf_layers.py --arms leaf,leaf_torch_linear   # within --leaf_layers: DeepSpeed's linear or torch's

The model is the shipped Gemma-3-1B config cut to ``--layers`` decoder layers and made ``--width`` wide (intermediate 2x,
head_dim 16, the demo's 4096-token tokenizer), random weights: the structure of the budget curve's Gemma-3 270M (18
layers), at a width where the host's work per module, not the matmuls, is the step, as on the GPU (issue 41: a 270M
step of 8 x 512 tokens took ~0.6 s on an H200, whose matmuls need ~20 ms). Each run is ``launch/prune.py`` under the
deepspeed launcher on one rank (``ds_configs/zero3.json``, the curve's config), ELSA at 90 % from the dense start, no
gradient checkpointing (as the curve), no validation, every parameter partitioned (``--persistence 0``: the stand-in's
tensors are below the shipped 1e5-entry threshold, the 270M's projections above it, so without it nothing inside a layer
would be fetched); its report's mean step time (the first step left out). The two ``--arms`` (:data:`ARMS`) alternate
A, B, B, A, ... so both see the same machine; the ratio is of the medians (A's over B's). Both arms' final losses are
printed: the same to float rounding.

The ``reference`` arm is the floor without DeepSpeed: ``elsa_ds/reference.py``'s single-process ELSA (the same
AdmmOptimizer over torch's Adam, the same loss and batches, the job's settings after the defaults rule) in one plain
process, fp32 weights and the forward under autocast to the job's compute dtype; its mean step leaves out the first, as
the report's does. Its math is not the job's to the bit (its own random init, autocast's casts): its loss (the model's
on the last batch, after the run) is printed, not compared.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elsa_ds.models import SHIPPED_CONFIGS  # noqa: E402
from elsa_ds.settings.config import DEMO_MODEL_DIR  # noqa: E402
from elsa_ds.zero.dist import free_port  # noqa: E402


def build_model(folder: Path, layers: int, width: int) -> Path:
    """Gemma-3-1B's config cut to ``layers`` and ``width``, with the demo's tokenizer (4096 tokens)."""
    config = json.loads((SHIPPED_CONFIGS / "google/gemma-3-1b-pt/config.json").read_text())
    types = (config.get("layer_types") or ["sliding_attention"] * 5 + ["full_attention"]) * layers
    config.update(num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width, head_dim=16, num_attention_heads=4,
                  num_key_value_heads=1, query_pre_attn_scalar=16, vocab_size=4096, sliding_window=64, max_position_embeddings=512,
                  layer_types=types[:layers])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, folder / name)
    return folder


# an arm: (--leaf_layers, zero_optimization.memory_efficient_linear in its config: None leaves DeepSpeed's default, its
# linear wrapper (an autograd Function); False: torch's F.linear, whose saved weight views keep each gathered weight
# until its backward)
ARMS = {"plain": (False, None), "leaf": (True, None), "leaf_torch_linear": (True, False), "reference": (False, None)}


def config(folder: Path, base: str, persistence: int, wrapped: bool | None = None) -> Path:
    """``base`` with ``stage3_param_persistence_threshold`` set (parameters smaller than it stay whole on every rank) and
    ``memory_efficient_linear`` where ``wrapped`` is not None."""
    ds = json.loads((ROOT / base).read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    if wrapped is not None:
        ds["zero_optimization"]["memory_efficient_linear"] = wrapped
    path = folder / f"ds_config_{wrapped}.json"
    path.write_text(json.dumps(ds, indent=1))
    return path


def run(model: Path, out: Path, leaf: bool, ds_config: Path, args) -> dict:
    """One job under ``ds_config``; its report's step time and final loss."""
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    cmd = [launcher, "--num_gpus", "1", "--master_port", str(free_port()), str(ROOT / "launch" / "prune.py"),
           "--deepspeed", str(ds_config), "--model", str(model), "--random_init", "--dataset", "shakespeare", "--method", "elsa",
           "--sparsity", "0.9", "--steps", str(args.steps), "--batch_size", str(args.batch), "--micro_batch", str(args.batch),
           "--seqlen", str(args.seqlen), "--init_mask", "none", "--val_windows", "0", "--baseline", "none",
           "--no-gradient_checkpointing", "--output_dir", str(out), "--overwrite", *(["--leaf_layers"] if leaf else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((out / "elsa_report.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {"leaf_layers": leaf, "step_time_s": report["step_time_s"], "final_loss": report["final_loss"]}


def run_reference(model: Path, ds_config: Path, args) -> dict:
    """The ``reference`` arm in a process of its own (the jobs' imports and threads as fresh as theirs)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reference_child", str(model), "--deepspeed", str(ds_config),
           *(f"--{k}={getattr(args, k)}" for k in ("steps", "batch", "seqlen"))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"leaf_layers": False, **json.loads(proc.stdout.strip().splitlines()[-1])}


def reference_child(model_dir: Path, args) -> dict:
    """ELSA through ``train_reference`` with the job's settings (as the launcher arms run it); its mean step after the
    first, and the final loss."""
    import time

    import torch
    from transformers import AutoTokenizer

    from elsa_ds import reference
    from elsa_ds.capacity.machine import cpu_bf16_fallback
    from elsa_ds.capacity.memory import model_config
    from elsa_ds.data import GlobalBatches, load_blocks
    from elsa_ds.loss import next_token_loss
    from elsa_ds.models import load_causal_lm
    from elsa_ds.plan.defaults_applied import apply_defaults
    from elsa_ds.settings.config import resolve_config
    from elsa_ds.targets import select_targets
    from elsa_ds.zero.ds_config import DsConfig
    from elsa_ds.zero.engine import model_dtype

    raw = DsConfig.load(str(args.deepspeed)).raw
    cpu_bf16_fallback(raw)  # the job's compute dtype on this CPU
    cfg = resolve_config(raw, {"model": str(model_dir), "dataset": "shakespeare", "method": "elsa", "sparsity": 0.9,
                               "steps": args.steps, "batch_size": args.batch, "micro_batch": args.batch, "seqlen": args.seqlen,
                               "init_mask": "none", "val_windows": 0, "baseline": "none", "gradient_checkpointing": False})
    cfg, _ = apply_defaults(cfg, model_config(str(model_dir)))
    blocks = load_blocks(cfg.dataset, "train", AutoTokenizer.from_pretrained(model_dir), cfg.seqlen,
                         max_blocks=cfg.steps * args.batch)
    model = load_causal_lm(str(model_dir), torch.float32, random_init=True)
    forward, dtype = model.forward, model_dtype(raw)

    def autocast_forward(*a, **k):  # the job's compute dtype; a bf16 model's own Adam and ADMM steps are ~10x slower here
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            return forward(*a, **k)

    model.forward = autocast_forward
    starts: list[float] = []

    class Timed(reference.AdmmOptimizer):  # type: ignore[misc, valid-type]
        def begin_step(self, step: int) -> None:
            starts.append(time.perf_counter())
            super().begin_step(step)

    reference.AdmmOptimizer = Timed
    batches = GlobalBatches(blocks, args.batch, args.batch, 1, 0, cfg.seed)
    reference.train_reference(model, cfg, batches, select_targets(model, cfg.targets), raw.get("gradient_clipping"))
    starts.append(time.perf_counter())
    with torch.no_grad():
        ids = batches.micro_batches(cfg.steps - 1)[0]
        loss = next_token_loss(model(input_ids=ids, use_cache=False).logits, ids).item()
    steps = [b - a for a, b in zip(starts, starts[1:])][1:]
    return {"step_time_s": sum(steps) / len(steps), "final_loss": loss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=18, help="decoder layers [18: Gemma-3 270M's]")
    ap.add_argument("--width", type=int, default=64, help="hidden size [64]")
    ap.add_argument("--steps", type=int, default=40, help="steps a run [40]")
    ap.add_argument("--batch", type=int, default=8, help="sequences a step, one forward [8]")
    ap.add_argument("--seqlen", type=int, default=64, help="[64]")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds: 2 runs of each a round [2]")
    ap.add_argument("--deepspeed", default="ds_configs/zero3.json", help="[zero3.json: the budget curve's]")
    ap.add_argument("--persistence", type=int, default=0, help="stage3_param_persistence_threshold [0: all partitioned]")
    ap.add_argument("--arms", default="plain,leaf", help=f"A,B: two of {', '.join(ARMS)} [plain,leaf]")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reference_child", type=Path, help=argparse.SUPPRESS)  # the reference arm's own process
    args = ap.parse_args(argv)
    if args.reference_child:
        print(json.dumps(reference_child(args.reference_child, args)))
        return 0
    arms = args.arms.split(",")
    if len(arms) != 2 or len(set(arms)) != 2 or not set(arms) <= set(ARMS):
        ap.error(f"--arms {args.arms!r}: two different names of {', '.join(ARMS)}, comma-separated")
    runs = []
    with tempfile.TemporaryDirectory(prefix="elsa_leaf_") as tmp:
        model = build_model(Path(tmp) / "model", args.layers, args.width)
        configs = {arm: config(Path(tmp), args.deepspeed, args.persistence, ARMS[arm][1]) for arm in arms}
        for r in range(args.rounds):
            a, b = arms if r % 2 == 0 else arms[::-1]
            for arm in (a, b, b, a):
                one = (run_reference(model, configs[arm], args) if arm == "reference" else
                       run(model, Path(tmp) / f"out_{len(runs)}", ARMS[arm][0], configs[arm], args))
                runs.append(one | {"arm": arm, "round": r})
                print(f"round {r} {arm}: {runs[-1]['step_time_s']:.4f} s a step, final loss {runs[-1]['final_loss']:.6f}",
                      flush=True)
    median = {arm: statistics.median(x["step_time_s"] for x in runs if x["arm"] == arm) for arm in arms}
    summary = {"model": {"config": "google/gemma-3-1b-pt", "layers": args.layers, "width": args.width},
               "job": {"deepspeed": args.deepspeed, "persistence": args.persistence, "steps": args.steps, "batch": args.batch,
                       "seqlen": args.seqlen, "ranks": 1},
               "arms": arms, "median_step_s": median, "speedup": median[arms[0]] / median[arms[1]], "runs": runs}
    print(f"median step: {median[arms[0]]:.4f} s {arms[0]}, {median[arms[1]]:.4f} s {arms[1]}: {summary['speedup']:.2f}x")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
