"""Quick screens of one setting: ELSA, fixed-mask fine-tuning or the dense control, trained in one process on the
readable reference path (``elsa_ds/reference.py``, plain torch Adam; no DeepSpeed), then scored on held-out text by
the evaluation code. The README's "exploration" tables come from it; ``bench/quality.py`` (ZeRO-3, the launcher) is
what confirms a finding.

    python bench/explore.py --mode elsa --sparsity 0.9 --out /tmp/x/e90                       # the demo, the rule's settings
    python bench/explore.py --mode elsa --sparsity 0.9 --set hold_steps=100 --out /tmp/x/h90   # one setting changed
    python bench/explore.py --mode ft --start /tmp/q/sparsegpt_90 --model ~/.cache/elsa_ds/models/docs-llama \\
        --dataset ~/.cache/elsa_ds/corpora/linux-doc/prune.jsonl --eval ~/.cache/elsa_ds/corpora/linux-doc/test.jsonl \\
        --sparsity 0.9 --set lr=6.59e-4 --out /tmp/x/sgft90                                    # SparseGPT + ft

--start: the weights training begins from (a pruned model: its zeros in the pruned layers are the mask that ``ft``
keeps, and ELSA's warm start of x and z, as ``--init_mask DIR --init_weights`` would be); ``--model`` names the model
whose size the defaults rule reads. Settings the user leaves unset come from the defaults rule exactly as
``launch/prune.py`` applies it (``ft`` and ``dense`` get the retraining rule); where the rule starts ELSA from a
one-shot's pruned model (a short budget up to 90 %), that one-shot runs here first, on the same calibration data.
The last line is JSON: mode, sparsity, the settings used, the held-out ppl, training seconds.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from elsa_ds.admm.projection import Slice  # noqa: E402
from elsa_ds.data import GlobalBatches, load_blocks  # noqa: E402
from elsa_ds.finetune.optimizer import MaskedOptimizer  # noqa: E402
from elsa_ds.jobs.evaluate import EvalSettings, run  # noqa: E402
from elsa_ds.methods import OneShot, oneshot_names  # noqa: E402
from elsa_ds.models import load_causal_lm  # noqa: E402
from elsa_ds.oneshot.pipeline import prune_oneshot  # noqa: E402
from elsa_ds.plan.defaults_applied import apply_defaults  # noqa: E402
from elsa_ds.reference import train_loop, train_reference  # noqa: E402
from elsa_ds.settings.config import DEMO_MODEL_DIR, resolve_config  # noqa: E402
from elsa_ds.targets import select_targets  # noqa: E402
from elsa_ds.zero.ds_config import DsConfig  # noqa: E402

MODES = {"elsa": {"method": "elsa"}, "ft": {"method": "magnitude", "finetune": "full"},
         "dense": {"method": "dense", "finetune": "full"}}


def parse_set(items: list[str]) -> dict:
    """``key=value`` pairs; a value that reads as JSON (numbers, true, lists) is taken as such."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected key=value (e.g. lr=2e-4)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def masked_training(model, cfg, batches, pruned: dict[int, str], clipping: float | None) -> None:
    """Adam with the start's zeros in the pruned layers held fixed (MaskedOptimizer: masked gradients and weights);
    no pruned layer: the dense control."""
    params = [p for p in model.parameters() if p.requires_grad]
    keep = {pruned[id(p)]: (p.detach() != 0).view(-1) for p in params if id(p) in pruned}
    opt = MaskedOptimizer(torch.optim.Adam(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=0.0),
                          initial_mask=lambda sl: keep[sl.layer])
    for p in params:
        if (name := pruned.get(id(p))) is not None:
            opt.assign(p, [Slice(name, 0, p.numel(), 0, p.numel(), int(keep[name].sum()))])
    train_loop(model, opt, cfg, batches, clipping)


def explore(a) -> dict:
    torch.manual_seed(0)
    raw = DsConfig.load(a.deepspeed).raw
    given = {"model": a.model, "dataset": a.dataset, "seqlen": a.seqlen, "steps": a.steps, **MODES[a.mode],
             **({"sparsity": a.sparsity} if a.mode != "dense" else {}),
             **({"init_mask": a.start, "init_weights": True} if a.start and a.mode == "elsa" else {}), **parse_set(a.set)}
    cfg = resolve_config(raw, given)
    start = a.start or a.model
    model = load_causal_lm(start, torch.float32)
    cfg, rule = apply_defaults(cfg, model.config)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    if a.mode == "elsa" and not a.start and cfg.init_mask is not None:  # the rule's one-shot start (or --set's)
        if not cfg.init_weights or cfg.init_mask not in oneshot_names():
            raise SystemExit("explore starts ELSA from the dense model, from a one-shot's pruned weights (init_mask=METHOD "
                             "init_weights=true, the rule's start up to 90 %) or from --start DIR")
        prune_oneshot(cfg, OneShot(cfg.init_mask), tok, model)  # in place
        start = f"{cfg.init_mask} of {a.model}"
    settings = {k: getattr(cfg, k) for k in ("lr", "lmda", "lmda_schedule", "interval", "hold_steps", "warmup_steps", "steps",
                                             "init_mask", "init_weights")}
    settings = {k: getattr(v, "value", v) for k, v in settings.items()}
    print("[explore]", json.dumps({"settings": settings, "from_rule": rule["applied"]}), flush=True)
    batch = raw["train_batch_size"]
    blocks = load_blocks(cfg.dataset, "train", tok, cfg.seqlen, max_blocks=cfg.steps * batch)
    batches = GlobalBatches(blocks, batch, batch, 1, 0, cfg.seed)
    pruned = select_targets(model, cfg.targets) if a.mode != "dense" else {}
    t0 = time.time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
        if a.mode == "elsa":
            train_reference(model, cfg, batches, pruned, raw.get("gradient_clipping"))
        else:
            masked_training(model, cfg, batches, pruned, raw.get("gradient_clipping"))
    seconds = time.time() - t0
    out = Path(a.out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    source = a.eval or cfg.dataset
    res = run(EvalSettings(model=str(out), ppl=[source], seqlen=cfg.seqlen, batch_size=8, limit=a.limit,
                           output=out / "eval.json"))
    zeros = {name: float((w == 0).float().mean()) for name, w in model.named_parameters() if id(w) in pruned}
    return {"mode": a.mode, "sparsity": None if a.mode == "dense" else a.sparsity, "start": start, "set": a.set,
            "settings": settings, "ppl": res["ppl"][source]["ppl"], "eval": source, "train_s": round(seconds, 1),
            "min_zeros": min(zeros.values()) if zeros else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="elsa")
    ap.add_argument("--model", default=str(DEMO_MODEL_DIR), help="the model (its size drives the defaults rule)")
    ap.add_argument("--start", default=None, help="weights to start from (default: --model); a pruned model for ft")
    ap.add_argument("--dataset", default=None, help="training text (default: the model's, e.g. the demo's plays)")
    ap.add_argument("--eval", default=None, help="held-out text to score on (default: --dataset's held-out part)")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="score at most this many windows")
    ap.add_argument("--set", nargs="*", default=[], help="settings, key=value (ElsaConfig fields)")
    ap.add_argument("--deepspeed", default=str(ROOT / "ds_configs" / "zero3_offload.json"), help="batch size and clipping")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.mode == "ft" and not a.start:
        ap.error("--mode ft retrains a pruned model: give it as --start")
    print(json.dumps(explore(a)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
