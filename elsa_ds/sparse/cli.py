"""``elsa-compress``: a pruned model folder to an elsa-sparse checkpoint, or a check of one (``--verify``).

    elsa-compress out/llama2-7b-90 out/llama2-7b-90-sparse          # any pruned HF folder: safetensors or .bin
    elsa-compress out/demo-90 out/demo-90-sparse --overwrite --max_shard_size 2GB
    elsa-compress --verify out/llama2-7b-90-sparse                   # read and check every tensor
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

from pydantic import BaseModel, ConfigDict, Field, field_validator

from elsa_ds.errors import ElsaError, OneLineParser, guarded, run_command
from elsa_ds.files.ownership import check_output_names
from elsa_ds.files.safetensors_writer import DEFAULT_MAX_SHARD_SIZE
from elsa_ds.log import get_logger
from elsa_ds.settings.config_checks import exact_kinds
from elsa_ds.settings.flags import add_flags, cli_fields, start_logging, validated
from elsa_ds.settings.options import JobOptions
from elsa_ds.sparse.compress import DEFAULT_MIN_SPARSITY, check_arguments, check_paths, compress
from elsa_ds.sparse.loader import verify
from elsa_ds.torch_api import resolve_mkl_vml

log = get_logger(__name__)


class CompressSettings(BaseModel):
    """elsa-compress's settings; --log_level is the other entry points' (JobOptions)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    input: Path = Field(..., json_schema_extra={"positional": True})
    """A pruned Hugging Face model folder (or, with --verify, a sparse checkpoint)."""
    output: Path | None = Field(None, json_schema_extra={"positional": True})
    """The sparse checkpoint to write (must not exist or be empty)."""
    min_sparsity: float = DEFAULT_MIN_SPARSITY
    """Store a 2-D weight compressed when at least this fraction is zero."""
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE
    """As save_pretrained's."""
    overwrite: bool = False
    """Replace a non-empty output folder that an elsa_ds command wrote (a folder of anything else is refused)."""
    verify: bool = False
    """Check INPUT, an elsa-sparse checkpoint (each tensor against its checksum), instead of writing one."""

    _exact_kinds = field_validator("*", mode="before")(exact_kinds)  # min_sparsity=True was 1.0


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="elsa-compress", description=__doc__.splitlines()[0].replace("``", ""),
                      formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]))
    add_flags(p, CompressSettings, flag_default=True)
    add_flags(p, JobOptions, ("log_level",))
    return p


def _run(settings: CompressSettings) -> None:
    if settings.verify:
        if settings.output is not None:
            raise ElsaError("--verify takes one folder, the sparse checkpoint to check")
        fields = CompressSettings.model_fields  # an audit (2026-12-07): taken without a word, read by nothing
        if written := [f"--{k}" for k in ("min_sparsity", "max_shard_size", "overwrite") if getattr(settings, k) != fields[k].default]:
            raise ElsaError(f"{', '.join(written)} shape{'s' if len(written) == 1 else ''} a checkpoint being written; --verify "
                            f"only reads one: drop {'it' if len(written) == 1 else 'them'}")
        log.info("%s: every tensor reads and checks: %s", settings.input, json.dumps(verify(settings.input)))
        return
    if settings.output is None:
        raise ElsaError("give the output folder: elsa-compress INPUT OUTPUT")
    # the cheap refusals come before anything is logged (a user's walk: a bad --min_sparsity came after the log line)
    check_arguments(settings.input, settings.output, settings.min_sparsity, settings.max_shard_size, settings.overwrite)
    check_paths(settings.input, settings.output, settings.overwrite)
    check_output_names(settings.output, "OUTPUT")
    log.info("compress %s -> %s (min_sparsity %s, max_shard_size %s)", settings.input, settings.output, settings.min_sparsity,
             settings.max_shard_size)
    done = compress(settings.input, settings.output, settings.min_sparsity, settings.max_shard_size, settings.overwrite)
    codes = [t["encoding"] for t in done["tensors"].values()]
    log.info("%d weights compressed (%d bitmask, %d delta8): %.3fx their dense bytes; weight files %.1f MB -> %.1f MB",
             len(codes), codes.count("bitmask"), codes.count("delta8"), done["pruned_bytes"] / done["pruned_dense_bytes"],
             done["input_bytes"] / 1e6, done["output_bytes"] / 1e6)


def main(argv: list[str] | None = None) -> int:
    """The entry point: an ElsaError (a bad setting among them) becomes one line on stderr and exit code 2."""
    args = parser().parse_args(argv)
    start_logging(args)
    resolve_mkl_vml()
    given = {k: v for k in cli_fields(CompressSettings) if (v := getattr(args, k)) is not None}
    return guarded(lambda: _run(validated(CompressSettings, given)))


def command() -> NoReturn:
    """``elsa-compress`` and ``launch/compress.py`` as a process's command (``errors.run_command``: the exit's work done,
    a closed console said once, then ``os._exit``)."""
    run_command(main)


if __name__ == "__main__":
    command()
