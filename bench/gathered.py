"""What ZeRO-3 keeps gathered from the forward to the backward, measured on a real engine, against the estimate's
``memory.gathered_params``: Gemma shapes with the proportions that matter (tensor sizes against the prefetch bucket, the
reuse distance and the live cap), every size and every knob scaled down alike, so that 2 CPU cores can run them.

    python bench/gathered.py            # the cases below, one rank each (DeepSpeed's CPU accelerator)
    python bench/gathered.py --json     # the last line: one JSON object

A case is a Gemma config whose tensors are the real model's x ``scale`` in entries (hidden, widths and the vocabulary x
sqrt(scale); fewer heads, each wider, so that the projections keep their sizes), under a shipped config's ZeRO-3 knobs
x ``scale`` (each knob counts entries), or with its reuse distance replaced. Three plain Adam steps of one 16-token
sequence; when the model's forward ends, the entries of the parameters DeepSpeed holds AVAILABLE (gathered) are summed:
the first step traces and releases everything, the later ones keep what the trace says is used again within the reuse
distance. The estimate's figure is for the scaled shape and knobs: the layers in flight (at least the largest tensor) or
what is kept for reuse (:func:`elsa_ds.capacity.memory.reused_params`), whichever is more.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, real model's config.json under elsa_ds/model_configs, layers, scale, shipped config, reuse distance or None)
CASES = (("Gemma-2-27B, 4 layers (the H200 jobs' shape)", "google/gemma-2-27b", 4, 1e-3, "zero3_offload", None),
         ("Gemma-2-27B, 4 layers, reuse 0 (bench/scale.py's fitted configs)", "google/gemma-2-27b", 4, 1e-3, "zero3_offload", 0.0),
         ("Gemma-2-27B, 46 layers", "google/gemma-2-27b", 46, 1e-3, "zero3_offload", None),
         ("Gemma-2-9B, 42 layers", "google/gemma-2-9b", 42, 1e-3, "zero3", None),
         ("Gemma-3-4B, 34 layers", "google/gemma-3-4b-pt", 34, 1e-3, "zero3", None),
         ("Gemma-2-2B, 26 layers", "google/gemma-2-2b", 26, 1e-3, "zero3", None),
         ("Gemma-3-1B, 26 layers", "google/gemma-3-1b-pt", 26, 1e-2, "zero3", None),
         ("Gemma-3-1B cut to 18 layers (Gemma-3 270M's count)", "google/gemma-3-1b-pt", 18, 1e-2 / 4, "zero3", None))
KNOBS = ("stage3_param_persistence_threshold", "stage3_max_reuse_distance", "stage3_max_live_parameters",
         "stage3_prefetch_bucket_size", "reduce_bucket_size")


def scaled_config(model: str, layers: int, scale: float) -> dict:
    """The real config's shape / ``scale`` in entries: widths and the vocabulary / sqrt(scale), heads kept."""
    from elsa_ds.models import SHIPPED_CONFIGS, load_config

    c = load_config(str(SHIPPED_CONFIGS / model)).get_text_config().to_dict() | {"num_hidden_layers": layers}
    c = {k: v for k, v in c.items() if k not in ("architectures", "rope_scaling", "rope_parameters", "transformers_version")}
    r = math.sqrt(scale)
    heads = max(1, round(c["num_attention_heads"] * r))  # the projections' widths scale, not their head count
    head_dim = 2 * max(4, round(c["num_attention_heads"] * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]) * r / heads / 2))
    c.update(hidden_size=heads * max(1, round(c["hidden_size"] * r / heads)), intermediate_size=max(16, round(c["intermediate_size"] * r)),
             num_attention_heads=heads, num_key_value_heads=max(1, round(c.get("num_key_value_heads", heads) * r)),
             head_dim=head_dim, vocab_size=max(64, round(c["vocab_size"] * r)), max_position_embeddings=64,
             sliding_window=min(c.get("sliding_window") or 64, 64), query_pre_attn_scalar=head_dim)
    c.pop("layer_types", None)
    return c


def run_case(config: dict, zero: dict) -> list[float]:
    """In a process of its own: the entries gathered after each of three forwards."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        (Path(tmp) / "zero.json").write_text(json.dumps(zero))
        proc = subprocess.run([sys.executable, __file__, "--child", tmp], capture_output=True, text=True, timeout=900, cwd=ROOT,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "RANK": "0",
                                   "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"case failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _port() -> int:
    from elsa_ds.zero.dist import free_port

    return free_port()


def child(folder: Path) -> None:
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    config = AutoConfig.for_model(**json.loads((folder / "config.json").read_text()))
    ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_force_ds_cpu_optimizer": False, "zero_optimization": {"stage": 3, **json.loads((folder / "zero.json").read_text())}}
    from elsa_ds import torch_api

    deepspeed.init_distributed(dist_backend="gloo")
    torch_api.prepare_torch_for_zero_init()  # as elsa_ds's engine does before zero.Init
    keep_alive = HfDeepSpeedConfig(ds)  # transformers builds the model in ZeRO-3 partitions (its zero.Init)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # torch's Adam: what stays gathered does not depend on the optimizer, and DeepSpeed's "Adam" on the CPU accelerator
    # is FusedAdam, a C++ op JIT-built on first use (~1 minute on a fresh 2-core machine)
    engine, *_ = deepspeed.initialize(model=model, config=ds, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4))
    assert keep_alive is not None
    ids = torch.randint(0, config.vocab_size, (1, 16))
    gathered = []
    for _ in range(3):
        loss = engine(input_ids=ids, labels=ids).loss
        gathered.append(float(sum(p.ds_numel for p in model.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE)))
        engine.backward(loss)
        engine.step()
    print(json.dumps(gathered))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    from transformers import AutoConfig

    from elsa_ds.capacity.memory import gathered_params, model_shape
    from elsa_ds.zero.ds_config import DsConfig

    rows = []
    for name, model, layers, scale, shipped, reuse in CASES:
        config = scaled_config(model, layers, scale)
        zero = {k: v * scale for k, v in DsConfig.load(shipped).zero.items() if k in KNOBS}
        if reuse is not None:
            zero["stage3_max_reuse_distance"] = reuse
        shape = model_shape(AutoConfig.for_model(**config))  # the config the child builds its model from
        first, *later = run_case(config, zero)
        estimate = gathered_params(shape, zero, False, "cuda")
        rows.append({"case": name, "config": shipped, "scale": scale, "params": shape.num_params,
                     "reuse_distance": zero["stage3_max_reuse_distance"], "measured_first_step": first,
                     "measured": max(later), "estimate": estimate, "ratio": round(estimate / max(later), 3) if max(later) else None})
        print(f"{name}: {shape.num_params:,} entries; gathered after the forward {max(later):,.0f} (first step {first:,.0f}), "
              f"estimated {estimate:,.0f}", flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
