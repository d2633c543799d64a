"""The entry points' argument parsing: generated from the settings models (``elsa_ds/settings/flags.py``), so a flag exists once.

``elsa-prune``'s flags are :class:`~elsa_ds.settings.options.JobOptions` and :class:`~elsa_ds.settings.config.ElsaConfig`;
``elsa-estimate`` takes the job settings it shares with them from the same fields, plus :class:`EstimateOptions`;
``elsa-evaluate``'s are :class:`~elsa_ds.jobs.evaluate.EvalSettings`; ``elsa-compress``'s (``sparse/cli.py``) its
``CompressSettings``. ``python -m elsa_ds.cli --flag-table`` prints the README's flag table from the fields of
``elsa-prune``. Errors become one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from elsa_ds.errors import ElsaError, OneLineParser, guarded, run_command  # noqa: F401 (guarded: the entry points')
from elsa_ds.log import get_logger
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.config_checks import INT_LIMIT, exact_kinds
from elsa_ds.settings.flags import add_flags, flag_table, start_logging, validated
from elsa_ds.settings.flags import cli_fields as _cli_fields
from elsa_ds.settings.options import JobOptions
from elsa_ds.version import __version__

log = get_logger(__name__)


def prune_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="elsa-prune", description="Prune a causal LM with ELSA (ADMM, objective-aware projection) "
                                "under DeepSpeed ZeRO-3, or with a one-shot baseline.")
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    add_flags(p, JobOptions, flag_default=True, grouped=True)
    add_flags(p, ElsaConfig, grouped=True)
    return p


def settings_from_args(args: argparse.Namespace):
    """(JobOptions, ElsaConfig as given, the DeepSpeed JSON as read) from parsed flags, validated: what the plan is made
    from (``elsa_ds/plan``)."""
    from elsa_ds.plan import read_settings
    from elsa_ds.settings.options import job_options

    opts = job_options({k: v for k in _cli_fields(JobOptions) if (v := getattr(args, k)) is not None})
    cfg, ds_config = read_settings(opts, {k: getattr(args, k) for k in _cli_fields(ElsaConfig)})
    return opts, cfg, ds_config


def main_prune(argv: list[str] | None = None) -> int:
    args = prune_parser().parse_args(argv)
    start_logging(args)

    def go() -> None:
        from elsa_ds.jobs.owner import run_owned

        opts, cfg, ds_config = settings_from_args(args)
        run_owned(cfg, opts, ds_config)

    return guarded(go)


def prune_command() -> NoReturn:
    """``elsa-prune`` and ``launch/prune.py`` as a process's command: ``main_prune``, then the process ends with its code
    once its exit work is done (``run_command``)."""
    run_command(main_prune)


# ---- elsa-estimate ----------------------------------------------------------------------------------------------------
class EstimateOptions(BaseModel):
    """elsa-estimate's own settings; the job's settings it shares with elsa-prune are ESTIMATE_SHARED."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str | None = Field(None, json_schema_extra={"metavar": "ID_OR_DIR"})
    """Hub id (shipped configs resolve offline), model directory or config.json; default: the recipe's model, else
    elsa-prune's (the embedded demo)."""
    num_gpus: int = Field(1, gt=0, le=INT_LIMIT)
    """GPUs (ranks) per node."""
    num_nodes: int = Field(1, gt=0, le=INT_LIMIT)
    """Nodes."""
    accelerator: Literal["cuda", "cpu"] = "cuda"
    """Where the ranks compute: cuda (GPUs), or cpu (DeepSpeed's CPU accelerator: no GPU, host memory only)."""
    machine: Literal["auto", "gpu-server", "gpu-vm-16c", "cpu-2c"] = "auto"
    """The host whose typical rates time the step: auto (gpu-server with cuda, cpu-2c with cpu), an 8-GPU server, the
    lent 1-GPU 16-core machine, a 2-core CPU box."""
    internode_gbps: float | None = Field(None, gt=0, allow_inf_nan=False)
    """GB/s a rank between nodes (default: the profile's 40, 400 Gb/s InfiniBand a GPU; cloud Ethernet is often 3-25):
    with --num_nodes above 1 most of a step's time, and --measure does not time it."""
    measure: bool = False
    """Time the step against rates measured on this machine (a few seconds: copies, a matmul, DeepSpeedCPUAdam)
    instead of a typical machine's; with --accelerator cpu a small job's own micro-step is also timed on its ranks here
    (20-40 s)."""

    _exact_kinds = field_validator("*", mode="before")(exact_kinds)  # num_gpus=True was one GPU

    @model_validator(mode="after")
    def _world_is_countable(self) -> EstimateOptions:
        if self.num_gpus * self.num_nodes > INT_LIMIT:
            raise ValueError(f"--num_gpus x --num_nodes must be at most {INT_LIMIT:,} ranks (2**53)")
        return self

    @model_validator(mode="after")
    def _machine_fits_accelerator(self) -> EstimateOptions:
        if self.machine != "auto" and (self.machine == "cpu-2c") != (self.accelerator == "cpu"):
            fits = "cpu-2c" if self.accelerator == "cpu" else "gpu-server or gpu-vm-16c"
            raise ValueError(f"--machine {self.machine} is a {'CPU' if self.machine == 'cpu-2c' else 'GPU'} host's profile but "
                             f"--accelerator is {self.accelerator}: pass --machine {fits} (or auto), or --accelerator "
                             f"{'cpu' if self.machine == 'cpu-2c' else 'cuda'}")
        return self


# The job settings the estimate depends on, read as elsa-prune reads them (not given: a recipe's, the JSON "elsa" block's,
# the demo profile's, the defaults rule's or the field's default): the batch and its activations, what is pruned and
# trained, the optimizer's and ADMM's state types, the authors' remedies (their eager parts), and what decides a one-shot
# warm start (--init_mask, or the defaults rule's SparseGPT start from steps, sparsity and a user's lr) and its working
# set; the steps, the projection interval and --leaf_layers (ZeRO-3's hooks) time the run; the export's format and the
# checkpoints size the disk under --output_dir. --random_init is not among them: both load paths build into partitions
# module by module under zero.Init.
ESTIMATE_SHARED: dict[type[BaseModel], tuple[str, ...]] = {
    JobOptions: ("deepspeed", "recipe", "log_level", "export_format"),
    ElsaConfig: ("seqlen", "batch_size", "micro_batch", "targets", "gradient_checkpointing", "freeze_embeddings", "base_optimizer",
                 "z_dtype", "u_dtype", "projection", "steps", "interval", "sparsity", "pattern", "sparsity_profile", "lr", "init_mask",
                 "init_weights", "nsamples", "val_windows", "lmda_schedule", "relaxation", "save_interval", "keep_checkpoints",
                 "leaf_layers"),
}


# the job's method and retraining: read, so that a job the estimate does not size (one-shot, retrained) is refused
ESTIMATE_REFUSED = ("method", "finetune")


def estimated_job(args: argparse.Namespace, opts: EstimateOptions, ds_config) -> tuple[ElsaConfig, str | None]:
    """The ElsaConfig of the job elsa-estimate sizes, resolved as elsa-prune resolves it: flags over the JSON's ``elsa``
    block and a recipe, then the defaults rule (which may start from a SparseGPT-pruned model: a one-shot warm start);
    and the line saying what the rule set (None if nothing), for the caller to print once nothing refuses the job."""
    from elsa_ds.capacity.memory import model_config
    from elsa_ds.capacity.preflight import check_schedule
    from elsa_ds.methods import ELSA
    from elsa_ds.plan import elsa_settings
    from elsa_ds.plan.defaults_applied import apply_defaults

    given = {k: getattr(args, k) for k in (*ESTIMATE_SHARED[ElsaConfig], *ESTIMATE_REFUSED)}
    if opts.model is not None:
        model = Path(opts.model).expanduser()
        given["model"] = str(model.parent) if model.is_file() else opts.model
    cfg = elsa_settings(ds_config, args.deepspeed, args.recipe, given)
    if cfg.method.value != ELSA or cfg.finetune is not None:
        what = f"method {cfg.method.value}" if cfg.method.value != ELSA else f"--finetune {getattr(cfg.finetune, 'value', '')}"
        raise ElsaError(f"elsa-estimate sizes ELSA jobs, but the command line, the recipe or the JSON's elsa block sets {what}; "
                        "a one-shot or retraining job's host memory is checked by elsa-prune itself before it loads anything")
    cfg, defaults = apply_defaults(cfg, model_config(cfg.model))
    check_schedule(cfg, rank=0)  # what the job would refuse or warn about in its schedule, said here too
    applied = "; ".join(f"{k} {v}" for k, v in defaults["applied"].items())
    return cfg, f"from the defaults rule: {applied}" if applied else None


def job_only_flags() -> dict[type[BaseModel], tuple[str, ...]]:
    """elsa-prune's flags the estimate does not use (data, output, checkpoints, the method's own settings): accepted, so
    that a job's command line can be estimated as it stands (the job's own time hint says to)."""
    taken = {*_cli_fields(EstimateOptions), *ESTIMATE_REFUSED}
    return {model: tuple(n for n in _cli_fields(model) if n not in shared and n not in taken)
            for model, shared in ESTIMATE_SHARED.items()}


def estimate_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="elsa-estimate", description="Estimate GPU, CPU and NVMe memory of an ELSA job from configs alone.")
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    add_flags(p, EstimateOptions)
    for model, names in ESTIMATE_SHARED.items():
        add_flags(p, model, names)
    add_flags(p, ElsaConfig, ESTIMATE_REFUSED)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")  # output format, no setting
    unused = p.add_argument_group("elsa-prune's other flags: accepted as a job's command line gives them, not used by the "
                                  "estimate (it says which it left out)")
    for model, names in job_only_flags().items():
        add_flags(unused, model, names, flag_default=model is JobOptions, optional=names)  # type: ignore[arg-type]
    return p


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_measurable(opts: EstimateOptions) -> None:
    """What stops ``--measure`` here, said before anything is timed: no CUDA device for CUDA rates, or a /dev/shm its
    probe job's CPU ranks would hang on (a probe that cannot build its ops falls back to the typical figures itself)."""
    from elsa_ds.capacity.machine import shm_problem

    if opts.accelerator == "cuda" and not _cuda_here():
        raise ElsaError("--measure times this machine's rates and --accelerator is cuda (the default), but this machine has "
                        "no CUDA device: run it on the GPU host, pass --accelerator cpu for CPU ranks here, or drop "
                        "--measure for a typical GPU host's rates")
    if opts.accelerator == "cpu" and (why := shm_problem(opts.num_gpus)):  # the probe's ranks run here, all of them
        raise ElsaError(why)


def main_estimate(argv: list[str] | None = None) -> int:
    args = estimate_parser().parse_args(argv)
    start_logging(args)

    def go() -> None:
        from dataclasses import replace

        from elsa_ds.capacity.machine import this_gpu
        from elsa_ds.capacity.memory import format_estimate, gpu_room_note, job_estimate, resolved_job
        from elsa_ds.capacity.preflight import format_output, output_bytes
        from elsa_ds.capacity.probe import measure_job
        from elsa_ds.capacity.optimizer_probe import measure_optimizer
        from elsa_ds.capacity.step_time import DEFAULT_MACHINE, TYPICAL, format_time, job_matmul, measure, step_time
        from elsa_ds.plan.checks import check_deepspeed_reader
        from elsa_ds.plan.switches import check_switches
        from elsa_ds.zero.ds_config import DsConfig

        check_switches()  # before DeepSpeed's import (DEEPSPEED_TIMEOUT) and --measure's probe job (ELSA_DS_*)
        opts = validated(EstimateOptions, {k: getattr(args, k) for k in _cli_fields(EstimateOptions) if getattr(args, k) is not None})
        if opts.measure:
            _check_measurable(opts)
        left = [f"--{n}" for names in job_only_flags().values() for n in names  # the disk line sizes what is written
                if (v := getattr(args, n)) is not None and v is not False and n != "output_dir"]
        if left:
            log.info(f"not used by the estimate (the job's data, output, checkpoints and method settings): {', '.join(left)}")
        ds_config = DsConfig.load(args.deepspeed)
        cfg, rule = estimated_job(args, opts, ds_config)
        if why := ds_config.base_optimizer_problem(cfg, opts.accelerator):
            raise ElsaError(why)
        shape, ds = resolved_job(cfg, ds_config, opts.num_gpus * opts.num_nodes)
        check_deepspeed_reader(cfg, ds, ds_config.source)  # a plan the job would refuse is no plan
        if rule:  # said once the job's settings pass: a refusal is the one line a refused command prints
            log.info(rule)
        est = job_estimate(shape, ds, cfg, opts.num_gpus, opts.num_nodes, opts.accelerator)
        typical = TYPICAL[DEFAULT_MACHINE[opts.accelerator] if opts.machine == "auto" else opts.machine]
        rates = measure(opts.accelerator, typical, *job_matmul(shape, ds, cfg)) if opts.measure else typical
        if opts.internode_gbps:
            rates = replace(rates, inter=opts.internode_gbps * 1e9)
        # whether the model is small enough to time: the typical rate is the floor (a busy host's timed matmul is not)
        gate = max(rates.matmul_flops, typical.matmul_flops)
        timed = measure_job(shape, ds, cfg, opts.num_gpus, opts.num_nodes, opts.accelerator, gate) if opts.measure else None
        optimizer = measure_optimizer(cfg, ds_config) if opts.measure else None
        timing = step_time(shape, ds, cfg, opts.num_gpus, opts.num_nodes, opts.accelerator, rates, timed, optimizer)
        # the table and the JSON line are the command's product: stdout, whatever the log level
        print(format_estimate(est, opts.model or cfg.model, args.deepspeed, opts.num_gpus, opts.num_nodes, opts.accelerator),
              flush=True)
        if opts.accelerator == "cuda" and (note := gpu_room_note(est, this_gpu())):
            print(note, flush=True)
        written = output_bytes(shape, ds, cfg, args.export_format or "dense")
        print(format_time(timing), flush=True)
        if opts.num_nodes > 1:
            where = "--internode_gbps" if opts.internode_gbps else "typical InfiniBand; --internode_gbps gives your network"
            print(f"between nodes: {rates.inter / 1e9:g} GB/s a rank ({where})", flush=True)
        print(format_output(written, shape, cfg, ds), flush=True)
        if args.json:
            print(json.dumps({**json.loads(est.to_json()), "time": timing.to_dict(), "output_dir_bytes": written}))

    return guarded(go)


def estimate_command() -> NoReturn:
    """``elsa-estimate`` and ``launch/estimate.py`` as a process's command (``run_command``, as ``prune_command``)."""
    run_command(main_estimate)


# ---- elsa-evaluate ----------------------------------------------------------------------------------------------------
def evaluate_parser() -> argparse.ArgumentParser:
    from elsa_ds.jobs.evaluate import EvalSettings

    p = OneLineParser(
        prog="elsa-evaluate",
        description="Evaluate a (pruned) causal LM with the pruning papers' protocol: sparsity, perplexity, zero-shot accuracy.",
    )
    p.add_argument("--version", action="version", version=f"elsa_ds {__version__}")
    add_flags(p, EvalSettings, optional=("model",))
    add_flags(p, JobOptions, ("log_level",))
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="render result JSONs of several models as one markdown table, evaluate nothing")
    return p


def main_evaluate(argv: list[str] | None = None) -> int:
    from elsa_ds.jobs.evaluate import EvalSettings

    parser = evaluate_parser()
    args = parser.parse_args(argv)
    if args.compare and (args.model or args.ppl or args.tasks):
        parser.error("--compare renders existing results; drop --model/--ppl/--tasks")
    if not args.compare and not args.model:
        parser.error("--model is required (or --compare A.json B.json ...)")
    start_logging(args)
    from elsa_ds.torch_api import resolve_mkl_vml

    resolve_mkl_vml()

    def go() -> None:
        from elsa_ds.evaluation.tables import compare
        from elsa_ds.files.io import write_atomic
        from elsa_ds.files.output import made_folders
        from elsa_ds.files.ownership import owned
        from elsa_ds.jobs.evaluate import check_flags_read, check_new_files, check_settings, run

        if args.compare:
            check_new_files({"--markdown": args.markdown}, bool(args.overwrite))
            if args.markdown is not None and Path(args.markdown).resolve() in {Path(p).resolve() for p in args.compare}:
                raise ElsaError(f"--markdown {args.markdown} is one of the --compare inputs: give the table its own file")
            table = compare(args.compare)
            print(table, end="", flush=True)  # the table is the command's product: stdout
            if args.markdown is not None:
                with made_folders([args.markdown]), owned(args.markdown, "--markdown"):
                    write_atomic(args.markdown, table)
            return
        from elsa_ds.plan.switches import check_switches

        check_switches(deepspeed=False)  # the decode's switches, before a model loads (no DeepSpeed here)
        settings = validated(EvalSettings, {k: v for k in _cli_fields(EvalSettings) if (v := getattr(args, k)) is not None})
        check_flags_read(settings)  # the command line's: a job's own --eval_* passes what it has
        check_settings(settings)  # again under the lock, by run: a refusal for the path itself comes first
        with made_folders([settings.output, settings.markdown]), owned(settings.output, "--output"), \
                owned(settings.markdown, "--markdown"):
            run(settings)

    return guarded(go)


def evaluate_command() -> NoReturn:
    """``elsa-evaluate`` and ``launch/evaluate.py`` as a process's command (``run_command``, as ``prune_command``)."""
    run_command(main_evaluate)


if __name__ == "__main__":
    if sys.argv[1:] == ["--flag-table"]:
        print(flag_table(), end="")  # the table is the product
    else:
        prune_command()
