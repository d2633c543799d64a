"""ELSA step time vs plain ZeRO-3 fine-tuning of the same model, same config, same data, in one run.

    python bench/overhead.py --deepspeed ds_configs/zero3_offload.json [--rounds 3] [--json]
    deepspeed --num_gpus 2 bench/overhead.py --deepspeed ds_configs/zero3_offload.json

Two engines are built side by side in one process (one with AdmmOptimizer, one with the bare base
optimizer); they alternate in blocks of ``interval`` steps (ABBA order) so both see the same machine noise, and the
ELSA block always contains exactly one projection (amortized over the interval, as in a real run).
Prints per-step times, the ratio ELSA / plain, the time per projection and its share of ELSA's time;
with --json the last line is a JSON object with ``ratio`` and ``config``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepspeed", default="ds_configs/zero3_offload.json")
    ap.add_argument("--model", default=None, help="default: the embedded demo model")
    ap.add_argument("--dataset", default=None)
    ap.add_argument("--interval", type=int, default=None, help="default: the config's (32)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating blocks of `interval` steps per engine")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    from elsa_ds import launch_env
    from elsa_ds.log import setup_logging
    from elsa_ds.settings.config import resolve_config
    from elsa_ds.zero.ds_config import DsConfig

    setup_logging()
    ds_config = DsConfig.load(args.deepspeed)
    cfg = resolve_config(ds_config.raw, {"model": args.model, "dataset": args.dataset, "interval": args.interval, "val_windows": 0})
    import torch

    from elsa_ds.admm.schedule import learning_rate
    from elsa_ds.data import GlobalBatches, load_blocks, load_tokenizer
    from elsa_ds.models import ModelSource
    from elsa_ds.targets import select_targets
    from elsa_ds.zero import steps as zsteps
    from elsa_ds.zero.dist import init_distributed
    from elsa_ds.zero.engine import base_optimizer, build_admm_engine, full_shapes, initialize, load_partitioned

    ds = ds_config.resolve(cfg, launch_env.world_size())
    rank, world = init_distributed()
    steps = cfg.interval * args.rounds
    cfg = cfg.model_copy(update={"steps": steps + 1})  # the ELSA run never reaches its final projection
    tok = load_tokenizer(cfg.model)
    blocks = load_blocks(cfg.dataset, "train", tok, cfg.seqlen, max_blocks=steps * ds.train_batch_size)
    batches = GlobalBatches(blocks, ds.train_batch_size, ds.micro_batch_size, world, rank, cfg.seed)

    elsa_model = load_partitioned(ModelSource(cfg.model), ds, cfg.gradient_checkpointing)
    pruned = select_targets(elsa_model.model, cfg.targets)
    zero, admm = build_admm_engine(elsa_model.model, cfg, ds, pruned, cfg.layer_goals(full_shapes(elsa_model.model, pruned)))
    plain_model = load_partitioned(ModelSource(cfg.model), ds, cfg.gradient_checkpointing)
    plain_opt = base_optimizer(cfg, [p for p in plain_model.model.parameters() if p.requires_grad], ds)
    plain_engine, comm = initialize(plain_model.model, plain_opt, ds)

    def train_step(engine, optimizer, step: int) -> float:
        if optimizer is admm:
            admm.begin_step(step)
        lr = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
        return zsteps.train_step(engine, optimizer, comm, batches.micro_batches(step), lr)

    def timed(fn) -> float:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        fn()
        torch.distributed.barrier()
        return time.perf_counter() - t0

    train_step(plain_engine, plain_opt, 0)  # warm-up: lazy state, JIT, allocator
    plain_times, elsa_times, proj_times = [], [], []
    elsa_step = 0
    plain_step = 0
    for r in range(args.rounds):
        # ABBA order: which engine runs first alternates, so neither always follows the other's cache state
        for engine_name in (("plain", "elsa") if r % 2 == 0 else ("elsa", "plain")):
            for _ in range(cfg.interval):
                if engine_name == "plain":
                    plain_times.append(timed(lambda: train_step(plain_engine, plain_opt, plain_step)))
                    plain_step += 1
                else:
                    t = timed(lambda: train_step(zero.engine, admm, elsa_step))
                    (proj_times if admm.projected_this_step else elsa_times).append(t)
                    elsa_step += 1
    # the first ELSA step creates z and u (one-off, like Adam's lazy init); report it apart
    first = elsa_times.pop(0)
    plain = statistics.mean(plain_times[1:])
    elsa_plain_step = statistics.mean(elsa_times)
    projection = statistics.mean(proj_times) - elsa_plain_step
    elsa_amortized = elsa_plain_step + projection / cfg.interval
    result = {
        "config": args.deepspeed, "world_size": world, "interval": cfg.interval, "rounds": args.rounds,
        "plain_step_s": plain, "elsa_step_s_without_projection": elsa_plain_step, "elsa_step_s_amortized": elsa_amortized,
        "projection_s": projection, "projection_share": projection / cfg.interval / elsa_amortized,
        "first_elsa_step_s": first, "ratio": elsa_amortized / plain,
    }
    if rank == 0:
        print(f"plain ZeRO-3 step        {plain * 1e3:9.1f} ms")
        print(f"ELSA step (no projection) {elsa_plain_step * 1e3:9.1f} ms")
        print(f"projection               {projection * 1e3:9.1f} ms  "
              f"(every {cfg.interval} steps, {result['projection_share']:.1%} of ELSA time)")
        print(f"ELSA step, amortized     {elsa_amortized * 1e3:9.1f} ms")
        print(f"ratio ELSA / plain       {result['ratio']:9.3f}")
        if args.json:
            print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
