"""``elsa-compress``: a pruned model folder to an elsa-sparse checkpoint, or a check of one (``--verify``).

    elsa-compress out/llama2-7b-90 out/llama2-7b-90-sparse          # any pruned HF folder: safetensors or .bin
    elsa-compress out/demo-90 out/demo-90-sparse --overwrite --max_shard_size 2GB
    elsa-compress --verify out/llama2-7b-90-sparse                   # read and check every tensor
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from elsa_ds.errors import ElsaError, OneLineParser, guarded
from elsa_ds.safetensors_writer import DEFAULT_MAX_SHARD_SIZE
from elsa_ds.sparse.compress import DEFAULT_MIN_SPARSITY, check_paths, compress
from elsa_ds.sparse.loader import verify

log = logging.getLogger("elsa_ds.sparse")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="elsa-compress", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("input", type=Path, help="a pruned Hugging Face model folder (or, with --verify, a sparse checkpoint)")
    p.add_argument("output", type=Path, nargs="?", help="the sparse checkpoint to write (must not exist or be empty)")
    p.add_argument("--min_sparsity", type=float, default=DEFAULT_MIN_SPARSITY,
                   help=f"store a 2-D weight compressed when at least this fraction is zero [{DEFAULT_MIN_SPARSITY}]")
    p.add_argument("--max_shard_size", default=DEFAULT_MAX_SHARD_SIZE, help=f"as save_pretrained's [{DEFAULT_MAX_SHARD_SIZE}]")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--verify", action="store_true",
                   help="check INPUT, an elsa-sparse checkpoint (each tensor against its checksum), instead of writing one")
    p.add_argument("--log_level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format="%(message)s")
    if args.verify:
        if args.output is not None:
            raise ElsaError("--verify takes one folder, the sparse checkpoint to check")
        log.info("%s: every tensor reads and checks: %s", args.input, json.dumps(verify(args.input)))
        return
    if args.output is None:
        raise ElsaError("give the output folder: elsa-compress INPUT OUTPUT")
    check_paths(args.input, args.output, args.overwrite)  # the cheap refusals come before anything is logged
    log.info("compress %s -> %s (min_sparsity %s, max_shard_size %s)", args.input, args.output, args.min_sparsity, args.max_shard_size)
    done = compress(args.input, args.output, args.min_sparsity, args.max_shard_size, args.overwrite)
    codes = [t["encoding"] for t in done["tensors"].values()]
    log.info("%d weights compressed (%d bitmask, %d delta8): %.3fx their dense bytes; weight files %.1f MB -> %.1f MB",
             len(codes), codes.count("bitmask"), codes.count("delta8"), done["pruned_bytes"] / done["pruned_dense_bytes"],
             done["input_bytes"] / 1e6, done["output_bytes"] / 1e6)


def main(argv: list[str] | None = None) -> int:
    """The entry point: an ElsaError becomes one line on stderr and exit code 2."""
    args = parser().parse_args(argv)
    return guarded(lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
