"""The same short ELSA run under several DeepSpeed configs: time, memory, NVMe, loss and mask agreement.

    python launch/ablate_offload.py --configs ds_configs/zero3.json ds_configs/zero3_offload.json \\
        ds_configs/zero3_offload_elsal.json ds_configs/zero3_nvme.json --out out/ablation

Writes OUT/ablation.csv, OUT/ablation.md and OUT/ablation.png; each run's model and log stay in OUT.
Arguments after -- go to launch/prune.py (default: the embedded demo with --steps 32 --interval 16 --val_windows 0
--baseline none).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elsa_ds.errors import OneLineParser, guarded  # noqa: E402
from elsa_ds.log import get_logger  # noqa: E402
from elsa_ds.settings.flags import add_flags, positive_int, start_logging  # noqa: E402
from elsa_ds.settings.options import JobOptions  # noqa: E402

DEFAULT_PRUNE_ARGS = ["--steps", "32", "--interval", "16", "--val_windows", "0", "--baseline", "none"]


def check_run(config: str, out: Path, ranks: int, extra: list[str]) -> None:
    """The plan of one ablation run as its ``ranks`` ranks will make it (``run_ablation``'s output folder and, for an NVMe
    config, a folder on the disk of its swap folder, which the run makes): every check a job makes before it loads a
    weight, the pre-flight memory and disk check included. Nothing is written."""
    import os

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
        make_plan(cfg, opts, ds_config)
    finally:
        for k, v in launched.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="ablate_offload.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", required=True, help="DeepSpeed configs; the first is the mask reference")
    ap.add_argument("--out", type=Path, required=True, help="folder for the table, the plot and each run's model and log")
    ap.add_argument("--num_gpus", type=positive_int, default=2, help="ranks per run [2]")
    add_flags(ap, JobOptions, ("log_level",))
    ap.add_argument("prune_args", nargs=argparse.REMAINDER, help="-- then flags for launch/prune.py")
    args = ap.parse_args(argv)
    start_logging(args)
    extra = [a for a in args.prune_args if a != "--"] or DEFAULT_PRUNE_ARGS

    def go() -> None:
        from elsa_ds.capacity.ablation import run_ablation

        from elsa_ds.files.output import missing_parents, remove_if_empty

        made = missing_parents(args.out / "runs" / "any")  # the plan makes each run's parent: a refusal leaves none
        try:
            for c in args.configs:  # every run planned and checked as its job will (memory, disk, NVMe, the flags after --)
                check_run(c, args.out, args.num_gpus, extra)  # before the first one starts: a late refusal wastes the others
        except BaseException:
            remove_if_empty(made)
            raise
        rows = run_ablation(args.configs, args.out, args.num_gpus, extra)
        print((args.out / "ablation.md").read_text())  # the table is the command's product: stdout
        get_logger("elsa_ds.capacity.ablation").info(f"wrote {args.out / 'ablation.csv'}, {args.out / 'ablation.md'}, "
                                            f"{args.out / 'ablation.png'} ({len(rows)} configs)")

    return guarded(go)


if __name__ == "__main__":
    sys.exit(main())
