"""The same short ELSA run under several DeepSpeed configs: time, memory, NVMe, loss and mask agreement.

    python launch/ablate_offload.py --configs ds_configs/zero3.json ds_configs/zero3_offload.json \\
        ds_configs/zero3_offload_elsal.json ds_configs/zero3_nvme.json --out out/ablation

Writes OUT/ablation.csv, OUT/ablation.md and OUT/ablation.png; each run's model and log stay in OUT.
Arguments after -- go to launch/prune.py after the ablation's own (the embedded demo with --steps 32 --interval 16
--val_windows 0 --baseline none), so they add to those and override them.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elsa_ds.errors import OneLineParser, guarded  # noqa: E402
from elsa_ds.log import get_logger  # noqa: E402
from elsa_ds.settings.flags import add_flags, positive_int, start_logging  # noqa: E402
from elsa_ds.settings.options import JobOptions  # noqa: E402

DEFAULT_PRUNE_ARGS = ["--steps", "32", "--interval", "16", "--val_windows", "0", "--baseline", "none"]


def prune_args(given: list[str]) -> list[str]:
    """launch/prune.py's flags: the ablation's defaults, then the user's (after --), which win where both set one (a walk:
    ``-- --seqlen 128`` dropped every default, and the runs validated and trained the demo's full 512 steps)."""
    return [*DEFAULT_PRUNE_ARGS, *(a for a in given if a != "--")]


def check_run(config: str, out: Path, ranks: int, extra: list[str]) -> tuple[float, float]:
    """The plan of one ablation run as its ``ranks`` ranks will make it (``run_ablation``'s output folder and, for an NVMe
    config, a folder on the disk of its swap folder, which the run makes): every check a job makes before it loads a
    weight, the pre-flight memory and disk check included. Nothing is written. Returns (the bytes its output keeps under
    ``out``, the bytes it swaps there while it runs)."""
    import os

    import torch

    from elsa_ds.capacity.memory import job_estimate, model_shape
    from elsa_ds.capacity.preflight import output_bytes
    from elsa_ds.cli import prune_parser, settings_from_args
    from elsa_ds.files.disk_room import existing_ancestor
    from elsa_ds.plan import make_plan
    from elsa_ds.zero.ds_config import DsConfig

    name = Path(config).stem
    nvme = ["--nvme_path", str(existing_ancestor((out / "nvme" / name).resolve()))] if DsConfig.load(config).uses_nvme else []
    argv = [*extra, "--deepspeed", config, *nvme, "--output_dir", str(out / "runs" / name), "--overwrite"]
    opts, cfg, ds_config = settings_from_args(prune_parser().parse_args(argv))
    launched = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE=str(ranks), LOCAL_SIZE=str(ranks))  # as the launcher will set them for rank 0
    try:
        plan = make_plan(cfg, opts, ds_config)
    finally:
        for k, v in launched.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    shape = model_shape(plan.source.config(), plan.cfg.targets, freeze_embeddings=plan.cfg.freeze_embeddings)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    swapped = job_estimate(shape, plan.ds.raw, plan.cfg, ranks, 1, device).nvme_bytes if nvme else 0.0
    return sum(output_bytes(shape, plan.ds.raw, plan.cfg, opts.export_format).values()), swapped


def check_disk(out: Path, kept: list[float], swapped: list[float]) -> None:
    """Each run's own check sees the disk as it is; the runs keep their outputs under ``out`` one after another, and the
    NVMe run swaps there too (at worst last): all of it must fit the free space now (the 27B-shaped ablation on the lent
    machine: four 4-layer exports of ~6.9 GB and the NVMe run's swap files on a 54 GiB disk)."""
    from elsa_ds.capacity.preflight import this_machine
    from elsa_ds.errors import ElsaError

    gib = 2**30
    need, free = sum(kept) + max(swapped, default=0.0), min(this_machine([out.resolve()]).disks.values())
    if need > free:
        raise ElsaError(f"ablate_offload.py: the {len(kept)} runs keep ~{sum(kept) / gib:.1f} GiB of outputs under {out} and "
                        f"swap up to ~{max(swapped, default=0.0) / gib:.1f} GiB there: ~{need / gib:.1f} GiB, where "
                        f"{free / gib:.1f} GiB are free; fewer --configs, a smaller model or another --out")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="ablate_offload.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", required=True, help="DeepSpeed configs; the first is the mask reference")
    ap.add_argument("--out", type=Path, required=True, help="folder for the table, the plot and each run's model and log")
    ap.add_argument("--num_gpus", type=positive_int, default=2, help="ranks per run [2]")
    add_flags(ap, JobOptions, ("log_level",))
    ap.add_argument("prune_args", nargs=argparse.REMAINDER, help="-- then flags for launch/prune.py")
    args = ap.parse_args(argv)
    start_logging(args)
    extra = prune_args(args.prune_args)

    def go() -> None:
        from elsa_ds.capacity.ablation import run_ablation
        from elsa_ds.files.output import missing_folders, remove_if_empty
        from elsa_ds.files.ownership import owned

        made = missing_folders(args.out / "runs")  # the plan makes each run's parent: a refusal leaves none
        with contextlib.ExitStack() as held:
            try:
                args.out.resolve().parent.mkdir(parents=True, exist_ok=True)  # where --out's lock goes
                # one ablation at a time in --out (an audit: a second one started beside the first truncated its run's
                # log and was refused only after its measurements, pointing at a log that no longer held its reason)
                held.enter_context(owned(args.out, "--out"))
                # every run planned and checked as its job will, before the first one starts (a late refusal wastes the
                # others), then the disk all of them take together
                sizes = [check_run(c, args.out, args.num_gpus, extra) for c in args.configs]
                check_disk(args.out, [kept for kept, _ in sizes], [swap for _, swap in sizes])
            except BaseException:
                held.close()  # the lock first: the folders made for it may go
                remove_if_empty(made)
                raise
            rows = run_ablation(args.configs, args.out, args.num_gpus, extra)
        print((args.out / "ablation.md").read_text())  # the table is the command's product: stdout
        get_logger("elsa_ds.capacity.ablation").info(f"wrote {args.out / 'ablation.csv'}, {args.out / 'ablation.md'}, "
                                            f"{args.out / 'ablation.png'} ({len(rows)} configs)")

    return guarded(go)


if __name__ == "__main__":
    sys.exit(main())
