"""Everything the plan checks before a job loads a weight, starts a process group or writes a file.

Each check is cheap: the model's config, the headers of its weight files, a meta-device instance of the
architecture (names and shapes without memory), the DeepSpeed JSON, the output directory, lm-eval's task index.
A run that would fail later fails here, in seconds, with one line.
"""
from __future__ import annotations

from elsa_ds import launch_env
from elsa_ds.capacity import machine, preflight
from elsa_ds.capacity.memory import model_shape
from elsa_ds.capacity.shapes import check_nvme_param_buffers
from elsa_ds.data.hub_texts import check_hub_texts, task_repos, text_repos
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.zeroshot import expand_tasks
from elsa_ds.files.mask_file import MaskReader
from elsa_ds.files.output import check_output_dir
from elsa_ds.log import get_logger
from elsa_ds.loss import check_loss_choice
from elsa_ds.methods import DENSE, OneShot, oneshot_names
from elsa_ds.models import ModelSource, freeze_embeddings, hidden_size, meta_model, refuse_sparse_checkpoint
from elsa_ds.oneshot.pipeline import host_dtype, saved_dtype
from elsa_ds.plan.switches import check_switches
from elsa_ds.settings.config import NAMED_TEXT_SOURCES, ElsaConfig
from elsa_ds.settings.options import JobOptions
from elsa_ds.targets import goal_ratio, target_shapes
from elsa_ds.zero import checkpoint
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.ds_values import FIX, deepspeed_refusal
from elsa_ds.zero.rendezvous import check_rendezvous_port


def model_source(cfg: ElsaConfig, opts: JobOptions) -> ModelSource:
    return ModelSource(cfg.model, opts.model_object, opts.tokenizer_object)


def builds_engine(cfg: ElsaConfig) -> bool:
    """Whether the job builds a DeepSpeed engine: a one-shot job alone runs none."""
    return cfg.oneshot is None or cfg.finetune is not None


def check_deepspeed_reader(cfg: ElsaConfig, engine_config: dict, source: object) -> None:
    """ElsaError with what DeepSpeed's own reader refuses in ``engine_config`` (``source`` resolved for ``cfg``), for a
    job that builds an engine: DeepSpeed never reads a one-shot job's config."""
    if builds_engine(cfg) and (refusal := deepspeed_refusal(engine_config)):
        raise ElsaError(f"DeepSpeed config {source}: DeepSpeed's reader refuses it: {refusal}; {FIX}")


def check_resumed(cfg: ElsaConfig, opts: JobOptions) -> None:
    """``latest`` names a tag on disk, one is readable, no file needs a class outside the allow-list (no link there:
    ``check_resume``); then a run that saves checkpoints can write them there (an audit of OS permissions: said only
    after the model, the engine and the checkpoint had loaded)."""
    checkpoint.check_resume(opts.output_dir / "checkpoints")
    if cfg.save_interval and (why := machine.unwritable(opts.output_dir / "checkpoints")):
        raise ElsaError(f"--save_interval {cfg.save_interval} saves this run's checkpoints in the one it resumes, but {why}: "
                        "make it writable and run again, or drop --save_interval")


def before_work(cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig, world_size: int, source: ModelSource) -> DsConfig:
    """Run every check for ``cfg`` on ``world_size`` ranks; returns the engine's DeepSpeed config (``ds_config`` resolved)."""
    engine_used = builds_engine(cfg)
    check_switches()  # the environment's ELSA_DS_* switches: none taken for its default unread
    if engine_used:  # its rank 0 serves the process group's rendezvous: a port another job holds, said first
        check_rendezvous_port()
        check_loss_choice(machine.job_device())  # ELSA_DS_LOSS
        if why := machine.host_folders_problem(world_size, machine.job_device() == "cpu"):  # DeepSpeed's writes outside
            raise ElsaError(why)  # the output (an audit: a traceback from inside its start, or a hang past SIGTERM)
    check_output_dir(opts.output_dir, opts.overwrite, opts.resume, opts.restart)
    if opts.export_format == "sparse" and (cfg.method.value == DENSE or cfg.sparsity == 0 and not cfg.sparsity_profile):
        raise ElsaError("--export_format sparse stores pruned weights as values + positions, but this run prunes nothing "
                        f"(--method {cfg.method.value}, --sparsity {cfg.sparsity}); drop --export_format sparse")
    model_config = source.config()
    if not cfg.random_init:
        source.check_weights()
    source.check_tokenizer()  # every job tokenizes text (calibration, training or validation)
    meta = meta_model(model_config)
    largest = max(p.numel() for p in meta.parameters())
    ds = ds_config.resolve(cfg, world_size, hidden_size(model_config), largest_param=largest)
    check_deepspeed_reader(cfg, ds.raw, ds_config.source)  # before the model loads
    fallback = machine.cpu_bf16_fallback(ds.raw)
    if fallback and engine_used and launch_env.writes():
        get_logger(__name__).warning(fallback)
    if cfg.leaf_layers and engine_used and ds.param_device == "nvme":
        raise ElsaError("--leaf_layers fetches a decoder layer's parameters at once, but with offload_param on NVMe DeepSpeed "
                        "swaps each into one of its buffer_count buffers (a layer holds more than the shipped 5); drop "
                        "--leaf_layers or use a config whose parameters stay in memory (zero3_offload, zero3; without --nvme_path)")
    if ds_config.uses_nvme and (why := machine.nvme_unavailable()):
        raise ElsaError(why)
    if engine_used and (why := ds.base_optimizer_problem(cfg, machine.job_device())):
        raise ElsaError(why)
    check_goals(cfg, meta)
    check_init_mask(cfg, meta)
    check_nvme_param_buffers(meta, ds.raw, world_size)
    if cfg.save_interval or opts.resume:
        checkpoint.check_supported(ds)
    if opts.resume_if_any and engine_used and not cfg.save_interval and launch_env.writes():
        get_logger(__name__).warning("--resume_if_any without --save_interval: this run writes no checkpoint, so an attempt "
                                     "cut short starts over; pass --save_interval N to continue from every N-th step")
    if (written := checkpoint.resumed_fingerprint(opts.output_dir, opts.resume)) is not None:
        flag = "--resume_if_any" if opts.resume_if_any else "--resume"
        if refusal := checkpoint.resume_changes(written, cfg.resume_fingerprint(world_size), flag):
            raise ElsaError(refusal)
    if opts.resume:
        check_resumed(cfg, opts)
    if cfg.oneshot is not None:  # memory before the texts: a job this machine cannot hold is told so before a download
        element = (saved_dtype(ds.raw).itemsize if cfg.finetune is None  # the model as the job saves it; a retraining run's
                   else host_dtype().itemsize + (2 if ds.bf16 else 4))  # one-shot model stays beside its export
        preflight.check_oneshot(model_shape(model_config, cfg.targets, model=meta), cfg, opts, element)
    else:
        preflight.check_elsa(meta, ds.raw, cfg, opts, world_size, ds_config.raw)
    manager = check_eval_tasks(cfg)
    texts = text_repos([("--dataset", cfg.dataset), ("--val_dataset", cfg.val_dataset), *(("--eval_ppl", s) for s in cfg.eval_ppl)])
    tasks = task_repos(manager, expand_tasks(cfg.eval_tasks), "--eval_tasks") if manager else {}
    check_hub_texts(texts, tasks, NAMED_TEXT_SOURCES)
    if cfg.select_every and ds_config.optimizer_on_nvme:
        raise ElsaError("--select_every scores Π(x) from resident fp32 masters and Adam moments, which NVMe optimizer "
                        "offload swaps out; use zero3_offload (without --nvme_path) or drop --select_every")
    return ds


def check_goals(cfg: ElsaConfig, meta) -> None:
    """The target regex matches Linears, the profile's entries match pruned layers, N:M fits their shapes."""
    goals = cfg.layer_goals(target_shapes(meta, cfg.targets))
    if cfg.method.value != DENSE and not any(goal_ratio(goal) for goal in goals.values()):  # audit 13: a profile of zeros
        raise ElsaError(f"--sparsity_profile {cfg.sparsity_profile} gives every pruned layer 0: it prunes nothing; give a layer a "
                        "ratio in (0, 1) (the unpruned control is --method dense --finetune full)")
    nm, sparsegpt = cfg.nm, OneShot.sparsegpt.value
    if nm and cfg.blocksize % nm.m and sparsegpt in (cfg.method.value, cfg.init_mask):  # a thirteenth audit: a traceback
        whose = "" if cfg.method.value == sparsegpt else " (its warm start, --init_mask sparsegpt)"
        raise ElsaError(f"--blocksize {cfg.blocksize}: SparseGPT{whose} prunes {nm} a block of columns at a time, so the block "
                        f"must hold whole groups: give a multiple of {nm.m} (128, the default, is one)")
    weights = dict(meta.named_parameters(remove_duplicate=False))
    for name in goals if cfg.method.value != DENSE else ():  # audit 13: a tied lm_head trained, then failed the export
        if others := [n for n, p in weights.items() if p is weights[name] and n != name]:
            raise ElsaError(f"--targets prunes {name}, which is tied to {others[0]} (the model's tie_word_embeddings): one "
                            "tensor, saved once under the other name, and pruning it prunes that too; narrow --targets")
    if cfg.freeze_embeddings:
        freeze_embeddings(meta)
        frozen = [name for name in goals if not weights[name].requires_grad]
        if frozen:
            raise ElsaError(f"--freeze_embeddings keeps {', '.join(frozen)} fixed, but --targets prunes it; narrow --targets "
                            "or drop --freeze_embeddings")


def check_init_mask(cfg: ElsaConfig, meta) -> None:
    """--init_mask from a folder or mask file: every pruned weight there with this model's shape (headers), and zeros in
    it (one row of each weight read), before anything loads; otherwise the engine would find out after the model load."""
    if cfg.init_mask is None or cfg.init_mask in oneshot_names():
        return
    refuse_sparse_checkpoint(cfg.init_mask, "--init_mask")
    shapes = target_shapes(meta, cfg.targets)
    reader = MaskReader(cfg.init_mask)
    reader.check(shapes)
    if shapes and not any(bool((~reader.read(n, 0, reader.shapes[n][-1])).any()) for n in shapes):
        raise ElsaError(f"--init_mask {cfg.init_mask}: the first row of every pruned weight there is dense (no zeros), so it "
                        "holds no mask; give the folder a pruning job (or a one-shot method) wrote, or --init_mask sparsegpt")


def check_eval_tasks(cfg: ElsaConfig):
    """An unknown lm-eval task must not wait for the end of a multi-day run to be found; the task manager (None without
    tasks), whose YAMLs name the data the tasks need."""
    if not cfg.eval_tasks:
        return None
    from elsa_ds.evaluation.zeroshot import task_manager

    return task_manager(expand_tasks(cfg.eval_tasks), cfg.eval_include_path, "--eval_tasks", "--eval_include_path")
