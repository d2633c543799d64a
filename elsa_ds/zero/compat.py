"""Every access to DeepSpeed's (and torch's) private internals, in one place, behind a version check.

elsa_ds reads and edits ZeRO-3's flat fp32 partitions and 16-bit parameter shards, which DeepSpeed does not
expose as an API. The attributes used here were read off DeepSpeed 0.19.x (``runtime/zero/stage3.py``,
``runtime/zero/partition_parameters.py``, ``runtime/engine.py``, ``csrc/cpu/comm/shm.cpp``); see
``shared/notes/deepspeed-zero3.md``. Another minor version gets a warning once: re-read those files and
re-run the integration tests before trusting it.
"""
from __future__ import annotations

import contextlib
import glob
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from elsa_ds.errors import ElsaError

TESTED_DEEPSPEED = ((0, 19),)


def build_cpu_ops() -> None:
    """Build, or load from torch's cache, the DeepSpeed ops a CPU job's ranks load first (CPU Adam, the shm all-reduce):
    a rank stopped during a build leaves its lock, on which every later load waits. A failed build: the ranks report it."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = accelerator.create_op_builder(name)
        with contextlib.suppress(Exception):  # noqa: BLE001 - reported by the ranks that need it
            if builder is not None and builder.is_compatible(verbose=False):
                builder.load(verbose=False)


def check_deepspeed_version() -> None:
    """Warn once when DeepSpeed is a release whose internals elsa_ds has not been tested against."""
    import deepspeed

    major_minor = tuple(int(x) for x in deepspeed.__version__.split(".")[:2])
    if major_minor not in TESTED_DEEPSPEED:
        warnings.warn(f"elsa_ds was tested with DeepSpeed {', '.join('%d.%d' % v for v in TESTED_DEEPSPEED)}.x, not "
                      f"{deepspeed.__version__}; it relies on ZeRO-3 internals listed in elsa_ds/zero/compat.py", stacklevel=2)


def allow_recompiles(limit: int) -> None:
    """Let dynamo keep ``limit`` compiled entries per function (its default, 8, is one model's shapes): past it, a
    benchmark's later cells would run eagerly, unannounced."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(limit, torch._dynamo.config.recompile_limit)


@contextlib.contextmanager
def zero3_init_one_module_at_a_time() -> Iterator[None]:
    """Inside: transformers' ZeRO-3 weight initialization (``from_config`` under a live ``HfDeepSpeedConfig``) gathers
    one module's own parameters at a time (transformers 5.x gathers a module's with its children's: Gemma-2's q, k, v,
    o at once, four NVMe swap buffers each the size of the 256k-row embedding's partition). Collective. Architectures
    whose ``_init_weights`` writes only a module's own parameters (Gemma-2, Llama) are initialized exactly as before."""
    import transformers.integrations.deepspeed as hf_deepspeed

    original = hf_deepspeed.initialize_weights_zero3
    hf_deepspeed.initialize_weights_zero3 = _initialize_weights_own_parameters
    try:
        yield
    finally:
        hf_deepspeed.initialize_weights_zero3 = original


def _initialize_weights_own_parameters(model) -> None:
    import deepspeed
    from transformers.initialization import guard_torch_init_functions
    from transformers.modeling_utils import PreTrainedModel

    remote = model.is_remote_code()

    def visit(module, init_fn) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init_fn)
        params = list(module.parameters(recurse=False))
        if not params:
            init_fn(module, remote)
            return
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if deepspeed.comm.get_rank() == 0:
                init_fn(module, remote)

    with torch.no_grad(), guard_torch_init_functions():
        visit(model, model._initialize_weights)


# ---- ZeRO-3's module hooks ------------------------------------------------------------------------------------
def mark_leaf_layers(layers: torch.nn.ModuleList) -> None:
    """ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_module``): DeepSpeed hooks each layer whole, fetching and
    releasing all its parameters at once, and puts no hooks on the modules inside it. Before deepspeed.initialize."""
    from deepspeed.utils.z3_leaf_module import set_z3_leaf_module

    for layer in layers:
        set_z3_leaf_module(layer, True)
        layer.register_forward_pre_hook(_hidden_states_need_grad)


def _hidden_states_need_grad(layer: torch.nn.Module, args: tuple) -> None:
    """DeepSpeed reduces a leaf's gradients in a full backward hook (stage3.py, ``reduce_leaf_module_grads``), which torch
    ties to the layer's positional inputs and fires at once when none needs a gradient: layer 0's under frozen embeddings
    (--freeze_embeddings; LoRA), which would reduce gradients that do not exist yet. Its hidden states are made to need
    one (a tensor made without autograd: no graph changes; nothing fetched for the frozen embedding)."""
    if not torch.is_grad_enabled():
        return
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        raise ElsaError(f"--leaf_layers: {type(layer).__name__} was called without its hidden states as the first "
                        "positional argument, where DeepSpeed's leaf backward hook needs them; drop --leaf_layers")
    if not first.requires_grad and first.is_floating_point():
        first.requires_grad_(True)


def torch_linear_back() -> None:
    """Put torch's ``F.linear`` back where an earlier ``zero.Init`` of this process replaced it with DeepSpeed's wrapper
    (``memory_efficient_linear``, on by default: DeepSpeed never restores it), for a job whose config turns it off. Process
    wide, as DeepSpeed's replacement is: an engine of an earlier job still alive here runs torch's too (the same products;
    its gathered weights then live until their backward)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patcher

    if torch.nn.functional.linear is zero3_linear_wrap and hasattr(Patcher, "linear_bk"):
        torch.nn.functional.linear = Patcher.linear_bk


def leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ZeRO-3 treats as leaves."""
    from deepspeed.utils.z3_leaf_module import get_z3_leaf_modules

    return get_z3_leaf_modules(model)


# ---- stage 3 optimizer (S3 = DeepSpeedZeroOptimizer_Stage3) --------------------------------------------------
def placement_hints(model) -> tuple[list[str] | None, str | list[str] | None]:
    """transformers' hints for accelerate's placement, as its own ``device_map="auto"`` passes them: the module classes
    never split across devices (``_no_split_modules``), the keys ``dispatch_model`` leaves where they are."""
    return getattr(model, "_no_split_modules", None), getattr(model, "_skip_keys_device_placement", None)


def is_stage3(zero_optimizer) -> bool:
    return hasattr(zero_optimizer, "fp32_partitioned_groups_flat")


def sub_group_params(zero_optimizer) -> list[list[torch.nn.Parameter]]:
    """The parameters of every sub-group, in the order their shares sit in the sub-group's flat partition."""
    return zero_optimizer.fp16_groups


def flat_partition(zero_optimizer, sub_group: int) -> torch.Tensor:
    """This rank's fp32 flat partition of a sub-group (numel 0 while swapped out to NVMe)."""
    return zero_optimizer.fp32_partitioned_groups_flat[sub_group]


def flat_position(zero_optimizer, param: torch.nn.Parameter) -> tuple[int, int]:
    """(sub-group, offset in its flat partition) of a parameter's share."""
    sub_group, offset = zero_optimizer.grad_position[zero_optimizer.get_param_id(param)][:2]
    return sub_group, offset


def data_parallel_group(zero_optimizer):
    return zero_optimizer.dp_process_group


@contextlib.contextmanager
def editing_shards(zero_optimizer) -> Iterator[None]:
    """Release gathered parameters before editing 16-bit shards, re-gather persistent ones after. Collective.

    Parameters below stage3_param_persistence_threshold stay gathered between steps; without the re-gather the
    forward would keep using their old full copies.
    """
    zero_optimizer.checkpoint_event_prologue()
    yield
    zero_optimizer.checkpoint_event_epilogue()


# ---- ZeRO-3 parameters -----------------------------------------------------------------------------------------
def _with_deepspeed_attributes(tensor: torch.Tensor) -> Any:
    """``tensor`` itself, typed to carry the attributes DeepSpeed sets on it at runtime (ZeRO-3's ``ds_numel``,
    ``ds_shape``, ``ds_tensor``, ``partition_numel()``; the swapper's ``swappable``), which torch's stubs cannot know."""
    return tensor


def full_numel(param: torch.Tensor) -> int:
    return _with_deepspeed_attributes(param).ds_numel


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole parameter's shape, partitioned (built under zero.Init) or not yet (partitioned by deepspeed.initialize)."""
    return tuple(_with_deepspeed_attributes(param).ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)


def partition_numel(param: torch.Tensor) -> int:
    return _with_deepspeed_attributes(param).partition_numel()


def shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's 16-bit shard of a ZeRO-3 parameter (padding included), flattened."""
    return _with_deepspeed_attributes(param).ds_tensor.data.view(-1)


# ---- engine ------------------------------------------------------------------------------------------------------
def gather_16bit_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The whole 16-bit state dict on rank 0 (None elsewhere), gathered one layer at a time. Collective.

    On the CPU accelerator DeepSpeed hands back views into its gather buffers (a module's weight and bias share one
    coalesced buffer: OPT's fc1), which safetensors refuses to save; such views are copied. Tied parameters stay one
    tensor.
    """
    state_dict = engine._zero3_consolidated_16bit_state_dict()
    if state_dict is None:
        return None
    copies: dict[int, torch.Tensor] = {}
    for key, value in state_dict.items():
        if value.untyped_storage().nbytes() != value.numel() * value.element_size():
            state_dict[key] = copies.setdefault(id(value), value.clone())
    return state_dict


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def _zero_stage(value: Any) -> Any:
    """The member ``ZeroStageEnum(value)``: what a pickled ``zero_stage`` names, stood in for the class (see below)."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ZeroStageEnum(value)


def _zero_stage_named(stand_in: Any, name: Any) -> Any:
    """``getattr(ZeroStageEnum, name)``, as some Python 3.11 releases pickle a member (by name; 3.11.2: an audit found every
    resume refused): for the class's stand-in and a member's name alone."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    if stand_in is not _zero_stage or not isinstance(name, str) or name not in ZeroStageEnum.__members__:
        raise pickle.UnpicklingError(f"getattr of {name!r} on {stand_in!r}: only a ZeroStageEnum member's name is read")
    return ZeroStageEnum[name]


def checkpoint_globals() -> list[tuple[Callable[..., Any], str]]:
    """What a checkpoint's pickle may name beyond tensors and plain containers, as ``(callable, name in the pickle)``:
    S3's ``zero_stage`` (by value, or by name through ``getattr``) and its static ``loss_scaler``, in each rank's
    ``*optim_states.pt`` (``S3._rigid_state_dict``). Read off checkpoints of every job, base optimizer, offload and
    precision elsa_ds runs: re-read them when DeepSpeed changes (a missing name refuses every resume). The enum's name
    maps to a function returning the member, not to the class: torch's weights-only loader lets a pickle set any
    attribute (BUILD) on an instance of an allowed class, and a member is one object for the whole process (DeepSpeed
    compares stages with it). ``LossScaler`` is built fresh per load (its fields checked after it, ``loss_scaler_problem``)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [(_zero_stage, f"{ZeroStageEnum.__module__}.{ZeroStageEnum.__qualname__}"), (_zero_stage_named, "builtins.getattr"),
            (LossScaler, f"{LossScaler.__module__}.{LossScaler.__qualname__}")]


def loss_scaler_problem(engine) -> str | None:
    """After a resume's load: S3 takes its loss scaler from the checkpoint as pickled (``_rigid_load_state_dict``). The
    runs elsa_ds writes (bf16 or fp32; fp16 is refused) hold a static ``LossScaler`` with a positive finite scale and
    nothing else; what is wrong with the loaded one, or None."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    fields = vars(scaler) if type(scaler) is LossScaler else {}
    scale = fields.get("cur_scale")
    if set(fields) != {"cur_scale", "dynamic"} or fields["dynamic"] is not False or isinstance(scale, bool) \
            or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        return f"its loss scaler, a {type(scaler).__name__}, is not a static LossScaler holding a positive finite scale"
    return None


def replay_cpu_adam(engine) -> int:
    """After a resume, bring DeepSpeedCPUAdam's β1^t, β2^t (kept in its C++ optimizer, multiplied by β once a step:
    ``Adam_Optimizer::IncrementStep``) to what the uninterrupted run holds at the loaded step t: a new process would take
    ``pow(β, t + 1)`` at its first step, which differs from the product in float32's last bit, and so would every
    weight it steps (``xstep.DeepSpeedBiasCorrection`` for the fused flats). Steps 1..t are replayed on a one-entry
    tensor (the history is the optimizer's, not a parameter's). Returns t (0: nothing to replay, another optimizer)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    base = getattr(engine, "optimizer", None)
    base = getattr(base, "optimizer", base)  # ZeRO-3's optimizer holds the one it steps (ADMM's wrapper holds its base)
    base = getattr(base, "base", base)
    steps = [int(st["step"]) for st in getattr(base, "state", {}).values() if isinstance(st, dict) and "step" in st]
    if not isinstance(base, DeepSpeedCPUAdam) or not steps or not base.param_groups:
        return 0
    group = base.param_groups[0]
    beta1, beta2 = group["betas"]
    one = [torch.zeros(1) for _ in range(4)]
    for step in range(1, max(steps) + 1):  # lr 0: the one entry stays as it is
        base.ds_opt_adam.adam_update(base.opt_id, step, 0.0, beta1, beta2, group["eps"], group["weight_decay"],
                                     group["bias_correction"], *one)
    return max(steps)


@contextlib.contextmanager
def checkpoint_hooks(engine, before_collective: Callable[[], None], load: Callable[..., Any] | None = None) -> Iterator[None]:
    """Inside: ``before_collective()`` runs on each rank before the first collective that follows ``engine``'s reads or
    writes of a tag's files in ``load_checkpoint`` or ``save_checkpoint``; with ``load``, every file the load reads goes
    through ``load(path, map_location=None)``; the model states' names are globbed with the folder's own name escaped.

    DeepSpeed reads a tag's files through ``engine.checkpoint_engine.load`` (the model states by way of
    ``runtime/state_dict_factory.py``, each rank's optimizer states in ``_get_all_zero_checkpoint_state_dicts``), and
    its ``TorchCheckpointEngine`` unpickles them with ``torch.load(..., weights_only=False)``: whatever a pickle names
    would run (the universal-checkpoint loader reads past it; ``checkpoint.check_supported`` refuses that). Between its
    first barrier and ZeRO-3's ``checkpoint_event_epilogue`` (the persistent parameters' all-gather) a save or a load is
    rank-local for what elsa_ds writes (a save's tag check precedes its writes; a load's prologue partitions, the module
    state has nothing to fetch, no optimizer swapper): a rank that raised there left the others in that all-gather for
    good (walks: one rank's optimizer partition of another size, a full disk), so the ranks agree there first."""
    reader, optimizer = engine.checkpoint_engine, engine.optimizer
    original, epilogue, names = reader.load, optimizer.checkpoint_event_epilogue, engine._get_all_ckpt_names

    def agreed_epilogue(*args, **kwargs):
        before_collective()
        return epilogue(*args, **kwargs)

    def literal_names(checkpoints_path, tag):  # an audit: DeepSpeed's glob read "[x]" in a folder's name as a pattern
        return names(glob.escape(str(checkpoints_path)), glob.escape(str(tag)))

    reader.load, optimizer.checkpoint_event_epilogue = load or original, agreed_epilogue  # instance attributes: shadowing
    engine._get_all_ckpt_names = literal_names
    try:
        yield
    finally:
        reader.load, optimizer.checkpoint_event_epilogue = original, epilogue
        del engine._get_all_ckpt_names


def rank_checkpoint_files(engine, ckpt_dir: Path, tag: str) -> list[str]:
    """The files of ``tag`` that ``engine.load_checkpoint`` reads on this rank: its partition's model and optimizer
    states (the other ranks' are read only for an elastic checkpoint, which elsa_ds never writes)."""
    return [engine._get_ckpt_name(str(ckpt_dir), tag), engine._get_zero_ckpt_name(str(ckpt_dir), tag)]


# ---- optimizer state ----------------------------------------------------------------------------------------------
def swap_root(nvme_path: str | Path) -> Path:
    """Where DeepSpeed's swappers write under an ``nvme_path`` (``partitioned_param_swapper.py``, ``optimizer_utils.py``)."""
    return Path(nvme_path) / "zero_stage_3"


def swap_kinds(nvme_path: str | Path) -> list[Path]:
    """The folders DeepSpeed's swappers make under :func:`swap_root` that are there (links included, never followed):
    ``optimizer`` (``optimizer_utils.py``) and ``{dtype}params`` (``partitioned_param_swapper.py``); no other name."""
    root = swap_root(nvme_path)
    if root.is_symlink() or not root.is_dir():
        return []
    return sorted(kind for kind in root.iterdir() if kind.name == "optimizer" or _dtype_params(kind.name))


def _dtype_params(name: str) -> bool:
    """``{dtype}params``, as the parameter swapper names its folder (``str(dtype).split(".")[1]``: bfloat16params)."""
    stem = name.removesuffix("params")
    return stem != name and isinstance(getattr(torch, stem, None), torch.dtype)


def rank_swap_folders(nvme_path: str | Path, rank: int | str) -> list[Path]:
    """A rank's swap folders under ``nvme_path`` there: ``zero_stage_3/{optimizer,{dtype}params}/rank{R}``, none below a link."""
    below = (kind / f"rank{rank}" for kind in swap_kinds(nvme_path) if not kind.is_symlink())
    return [folder for folder in below if folder.exists() or folder.is_symlink()]


def swap_folders(engine) -> list[Path]:
    """The folders this rank's NVMe swap files are in (none without NVMe offload): the optimizer swapper's and the
    parameter swapper's (``Init`` gives every parameter its ``nvme_swapper``, None without NVMe: the first one's read)."""
    folders = []
    if (optimizer_swapper := getattr(engine.optimizer, "optimizer_swapper", None)) is not None:
        folders.append(Path(optimizer_swapper.swap_folder))
    first = next(iter(engine.module.parameters()), None)
    if (param_swapper := getattr(first, "nvme_swapper", None)) is not None:
        folders.append(Path(param_swapper.swap_folder))
    return folders


def release_engine(engine, destroy: bool = True) -> None:
    """An engine a job is done with given up (``destroy``, unless False), with what ZeRO-3 keeps of it at module level:
    its modules on the forward's module stack, the coordinator's cache of what to release (an API job's leak, an audit)."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    try:
        if destroy:
            engine.destroy()
    finally:
        ours = {id(m) for m in engine.module.modules()} if isinstance(getattr(engine, "module", None), torch.nn.Module) else set()
        parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in ours]
        method = vars(Coordinator).get("_PartitionedParameterCoordinator__params_to_release")  # lru_cache, under nvtx's wrapper
        for cached in (method, *(cell.cell_contents for cell in getattr(method, "__closure__", None) or ())):
            if callable(getattr(cached, "cache_clear", None)):
                cached.cache_clear()


def keep_out_of_swapper(tensor: torch.Tensor) -> None:
    """Mark an optimizer state the NVMe swapper must leave in memory (it reads every swapped state back as fp32)."""
    _with_deepspeed_attributes(tensor).swappable = False
