"""Load an elsa-sparse checkpoint as a transformers model: decompressed (``dense``) or with SparseLinear (``sparse``).

The model is built from its config without initialising weights, then every stored tensor is checked and copied
into place one at a time; in ``sparse`` mode each compressed nn.Linear weight becomes a SparseLinear instead.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from elsa_ds.admm.kernels import build
from elsa_ds.errors import first_line
from elsa_ds.log import get_logger
from elsa_ds.sparse import format as fmt
from elsa_ds.sparse.folder import TensorReader, inside
from elsa_ds.sparse.integrity import (SparseArgumentError, SparseArgumentTypeError, SparseCheckpointError, check_type,
                                      tensor_digest)
from elsa_ds.sparse.kernels import loops_choice
from elsa_ds.sparse.linear import SparseLinear, check_decode_path, default_path, gpu_layout
from elsa_ds.sparse.saving import saves_dense
from elsa_ds.sparse.siblings import fuse_wanted, ready_to_decode
from elsa_ds.sparse.meta import CONFIG_KEY, UNSEALED_VERSION, elsa_named, sparse_meta
from elsa_ds.torch_api import resolve_mkl_vml

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MODES = ("dense", "sparse")
log = get_logger(__name__)


def stored_tensors(path: Path, meta: dict, verify: bool = True) -> Iterator[tuple[str, torch.Tensor | tuple[str, tuple[int, int], dict]]]:
    """Each weight of the checkpoint once, in stored order: a plain tensor, or (encoding, shape, checked parts).

    ``verify``: every stored tensor against its recorded checksum (``meta`` from ``sparse_meta``, which checked it)."""
    reader = TensorReader(path, elsa_named(meta))
    digests = _digests(path, reader, meta) if verify else None
    compressed, done = meta["tensors"], set()
    owner = {f"{name}.{part}": name for name, info in compressed.items() for part in fmt.PARTS[info["encoding"]]}
    for stored in reader.names:
        name = owner.get(stored)
        if name is None:
            yield stored, _read(reader, stored, digests)
        elif name not in done:
            done.add(name)
            yield name, _compressed(reader, name, compressed[name], digests)
    absent = [n for n in compressed if n not in done]
    if absent:
        raise SparseCheckpointError(f"{path}: config.json lists {absent[0]} as compressed but no shard holds it; "
                                    "the checkpoint is incomplete")


def _digests(path: Path, reader: TensorReader, meta: dict) -> dict[str, str] | None:
    """The recorded digest of every stored tensor (None: version 1, which records none); the names must agree."""
    if meta["version"] == UNSEALED_VERSION:
        return None
    digests = meta["checksum"]["tensors"]
    unlisted = [n for n in reader.names if n not in digests]
    if unlisted:
        raise SparseCheckpointError(f"{reader.where(unlisted[0])}: holds {unlisted[0]}, for which config.json records no "
                                    "checksum: the checkpoint was changed after it was written")
    absent = [n for n in digests if n not in reader]
    if absent:
        raise SparseCheckpointError(f"{path}: config.json records a checksum for {absent[0]}, which no shard holds; "
                                    "the checkpoint is incomplete")
    return digests


def _read(reader: TensorReader, name: str, digests: dict[str, str] | None) -> torch.Tensor:
    tensor = reader.get(name)
    if digests is not None and tensor_digest(name, tensor) != digests[name]:
        raise SparseCheckpointError(f"{reader.where(name)}: {name} does not match its recorded checksum: the file was changed "
                                    "or corrupted (compress the model again; verify=False skips the checks)")
    return tensor


def _compressed(reader: TensorReader, name: str, info: dict, digests: dict[str, str] | None) -> tuple[str, tuple[int, int], dict]:
    """One compressed weight's parts, read (and checked against their digests) and checked as a code."""
    encoding, shape = info["encoding"], tuple(info["shape"])
    parts = {p: _read(reader, f"{name}.{p}", digests) for p in fmt.PARTS[encoding] if f"{name}.{p}" in reader}
    try:
        fmt.check(name, encoding, shape, parts)
        values = parts["values"]
        if str(values.dtype).removeprefix("torch.") != info["dtype"] or values.numel() != info["entries"]:
            raise SparseCheckpointError(f"{name}.values: {values.numel()} {values.dtype} entries, config.json says "
                                        f"{info['entries']} {info['dtype']}; the sparse checkpoint is corrupt")
    except SparseCheckpointError as err:
        raise SparseCheckpointError(f"{reader.where(f'{name}.values') if 'values' in parts else reader.folder}: {err}") from None
    return encoding, shape, parts


def verify(path: str | Path) -> dict:
    """Read and check every tensor of a sparse checkpoint against its checksum (no model built); returns counts per code."""
    check_type("path", path, (str, os.PathLike), "a folder path (str or Path)")
    path = Path(path)
    meta = sparse_meta(path)
    counts = {"plain": 0, fmt.BITMASK: 0, fmt.DELTA8: 0}
    for _, item in stored_tensors(path, meta):
        counts["plain" if torch.is_tensor(item) else item[0]] += 1
    return counts


def _empty_model(path: Path, dtype: torch.dtype | None) -> PreTrainedModel:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or getattr(config, "dtype", None) or torch.float32,
                                                     trust_remote_code=False)
    except Exception as err:  # whatever the modeling code raises on a config it cannot take
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "validation error for X:" says nothing alone
        raise SparseCheckpointError(f"{path}: transformers cannot build a causal LM from its config.json ({first})") from None
    model.tie_weights()  # no_init_weights skips init_weights, which is where transformers ties them
    _generation_config(model, path)
    if hasattr(model.config, CONFIG_KEY):  # the block describes the files, not the model: a save of it is dense
        delattr(model.config, CONFIG_KEY)
    return model


def _generation_config(model: PreTrainedModel, path: Path) -> None:
    """The folder's generation_config.json, as transformers' from_pretrained reads it (from_config builds one from the
    config alone: its use_cache, max_new_tokens and token ids would override the exported ones). JSON only."""
    from transformers import GenerationConfig

    if not (path / "generation_config.json").is_file():
        return
    inside(path, "generation_config.json", path)  # a link out of the folder (the hub cache's own excepted) is refused
    try:
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, RecursionError) as err:  # as transformers' from_pretrained: the config's defaults
        log.warning(f"{path}: generation_config.json cannot be read ({first_line(err)}); generate() takes config.json's "
                    "defaults")


def from_pretrained(path: str | Path, mode: str = "dense", dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    decode_path: str | None = None, verify: bool = True) -> PreTrainedModel:
    """A transformers causal LM from an elsa-sparse checkpoint, in eval mode on ``device``.

    ``mode="dense"``: every weight decompressed (bit for bit the dense export). ``mode="sparse"``: every compressed
    nn.Linear weight kept compressed in a SparseLinear (``decode_path``: kernel, csr or reference; default the C++
    kernel where built and the values are fp32 or bf16, else csr; on CUDA the Triton kernel, and generate() takes a
    static cache, so that it compiles its decode step into a CUDA graph). ``dtype``: the stored dtype by default.
    ``verify=False`` skips the checksums (config.json's and every tensor's, one SHA-256 pass over the weights' bytes):
    faster, and a corrupted or edited checkpoint then loads as whatever it now holds. The checks of each code's
    structure (counts, ranges) always run. A bad checkpoint raises SparseCheckpointError (a ValueError), a bad
    argument SparseArgumentError (ValueError) or SparseArgumentTypeError (TypeError); all three are ElsaErrors.
    """
    path = _check_arguments(path, mode, dtype, device, decode_path, verify)
    resolve_mkl_vml()  # the model's rotary cos/sin and the decode's first ops: computed on two threads at once
    meta = sparse_meta(path, verify)
    model = _empty_model(path, dtype)
    dtype = next(model.parameters()).dtype
    targets = model.state_dict(keep_vars=True)
    loaded: set[str] = set()
    for name, item in stored_tensors(path, meta, verify):
        if not torch.is_tensor(item) and mode == "sparse" and _replace_linear(model, name, item, dtype, decode_path):
            loaded.add(name)
            continue
        _copy_into(targets, name, item)
        loaded.add(name)
    _check_complete(path, model, targets, loaded)
    # PreTrainedModel.to is wrapped with functools.wraps(nn.Module.to), whose stubs drop the binding of self: called
    # as nn.Module's to (PreTrainedModel's own still runs), which moves the module in place
    cast(torch.nn.Module, model).to(device)
    if mode == "sparse":
        model.requires_grad_(False)  # for inference: a forward outside no_grad still takes the kernels (a LoRA's own
        saves_dense(model)           # parameters, an input's gradient: the dense path, which carries it)
        ready_to_decode(model, torch.device(device))
    return model.eval()


def _check_arguments(path: str | Path, mode: str, dtype: torch.dtype | None, device: str | torch.device,
                     decode_path: str | None, verify: bool) -> Path:
    """Each argument of ``from_pretrained`` of the right type and value, or one line saying which is not (typed as
    ``from_pretrained`` declares them: the checks are for callers that ignore the declaration)."""
    check_type("path", path, (str, os.PathLike), "a folder path (str or Path)")
    check_type("mode", mode, str, f"one of {', '.join(MODES)}")
    if mode not in MODES:
        raise SparseArgumentError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    if dtype is not None:
        check_type("dtype", dtype, torch.dtype, "a torch.dtype such as torch.bfloat16, or None")
        if not dtype.is_floating_point:
            raise SparseArgumentError(f"dtype={dtype}: expected a floating dtype such as torch.bfloat16")
    check_type("device", device, (str, torch.device), "a device such as 'cpu' or 'cuda:0'")
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise SparseArgumentError(f"device={device!r}: {str(err).splitlines()[0]}") from None
    if where.type == "meta":
        raise SparseArgumentError(f"device={device!r}: the meta device holds no weights; load to 'cpu' or a GPU")
    if where.type == "cuda" and (not torch.cuda.is_available() or (where.index or 0) >= torch.cuda.device_count()):
        raise SparseArgumentError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
                                  f"{'' if torch.cuda.is_available() else ' (torch without CUDA, or no GPU)'}; load to 'cpu'")
    check_decode_path(decode_path, mode)
    check_type("verify", verify, bool, "True or False")
    if mode == "sparse":  # the decode switches in the environment, said before the load (an audit: after it)
        if why := build.switch_problem("ELSA_DS_KERNELS"):
            raise SparseArgumentError(why)
        fuse_wanted(where)
        loops_choice()
        if where.type == "cuda":
            gpu_layout()
    return Path(path)


def _replace_linear(model: torch.nn.Module, name: str, item: tuple, dtype: torch.dtype, decode_path: str | None) -> bool:
    """Put a SparseLinear where ``name`` is an nn.Linear's weight; False when it is not (it is then loaded dense)."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name) if module_name else model
    except AttributeError:  # no such module: _copy_into names the tensor the model lacks
        return False
    if leaf != "weight" or not isinstance(module, torch.nn.Linear):
        return False
    encoding, shape, parts = item
    if tuple(module.weight.shape) != shape:
        raise SparseCheckpointError(f"{name}: stored shape {shape}, the model's config says {tuple(module.weight.shape)}")
    delta8 = fmt.to_delta8(encoding, shape, parts)
    delta8["values"] = delta8["values"].to(dtype)
    sparse = SparseLinear(delta8, shape, module.bias, decode_path=default_path(dtype, decode_path), name=name)
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, sparse)
    return True


def _copy_into(targets: dict[str, torch.Tensor], name: str, item: torch.Tensor | tuple) -> None:
    """A stored tensor, or a compressed weight decoded (only once its shape is the model's), into its place."""
    target = targets.get(name)
    if target is None:
        raise SparseCheckpointError(f"the checkpoint holds {name}, which this model (built from its config.json) does not have")
    shape = tuple(item.shape) if torch.is_tensor(item) else item[1]
    if tuple(target.shape) != shape:
        raise SparseCheckpointError(f"{name}: stored shape {shape}, the model's config says {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(item if torch.is_tensor(item) else fmt.decode(*item))


def _check_complete(path: Path, model: torch.nn.Module, targets: dict[str, torch.Tensor], loaded: set[str]) -> None:
    """Every parameter and persistent buffer got a stored value (tied weights share the one stored)."""
    filled = {id(t) for n, t in targets.items() if n in loaded}
    now = model.state_dict(keep_vars=True)
    missing = [n for n, t in now.items() if n not in loaded and id(targets.get(n, t)) not in filled and not _in_sparse(n, loaded)]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise SparseCheckpointError(f"{path}: the checkpoint lacks {missing[0]}{more}")


def _in_sparse(name: str, loaded: set[str]) -> bool:
    """A SparseLinear's buffers (values, deltas, row_offsets) came from its stored weight."""
    module, _, leaf = name.rpartition(".")
    return leaf in fmt.PARTS[fmt.DELTA8] and f"{module}.weight" in loaded

