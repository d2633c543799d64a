"""Load an elsa-sparse checkpoint as a transformers model: decompressed (``dense``) or with SparseLinear (``sparse``).

The model is built from its config without initialising weights, then every stored tensor is checked and copied
into place one at a time; in ``sparse`` mode each compressed nn.Linear weight becomes a SparseLinear instead.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from elsa_ds.errors import ElsaError
from elsa_ds.sparse import format as fmt
from elsa_ds.sparse.compress import CONFIG_KEY, read_config
from elsa_ds.sparse.folder import TensorReader
from elsa_ds.sparse.linear import SparseLinear

MODES = ("dense", "sparse")
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def sparse_meta(path: Path) -> dict:
    """The checkpoint's ``elsa_sparse`` block, checked: ElsaError for a dense folder or an unknown format version."""
    meta = read_config(path).get(CONFIG_KEY)
    if meta is None:
        raise ElsaError(f"{path} is not an elsa-sparse checkpoint (its config.json has no {CONFIG_KEY!r}); "
                        "load a dense folder with transformers' from_pretrained, or make a sparse one with elsa-compress")
    if not isinstance(meta, dict) or meta.get("format") != fmt.FORMAT or not isinstance(meta.get("tensors"), dict):
        raise ElsaError(f"{path}: config.json's {CONFIG_KEY!r} is not an {fmt.FORMAT} block")
    if meta.get("version") != fmt.VERSION:
        raise ElsaError(f"{path}: {fmt.FORMAT} format version {meta.get('version')!r}; this elsa_ds reads version {fmt.VERSION} "
                        "(upgrade elsa_ds, or compress the dense model again)")
    return meta


def stored_tensors(path: Path, meta: dict) -> Iterator[tuple[str, torch.Tensor | tuple[str, tuple[int, int], dict]]]:
    """Each weight of the checkpoint once, in stored order: a plain tensor, or (encoding, shape, checked parts)."""
    reader = TensorReader(path)
    compressed, done = meta["tensors"], set()
    owner = {f"{name}.{part}": name for name, info in compressed.items() for part in fmt.PARTS.get(info.get("encoding"), ())}
    for stored in reader.names:
        name = owner.get(stored)
        if name is None:
            yield stored, reader.get(stored)
        elif name not in done:
            done.add(name)
            info = compressed[name]
            shape = tuple(info.get("shape", ()))
            parts = {p: reader.get(f"{name}.{p}") for p in fmt.PARTS[info["encoding"]] if f"{name}.{p}" in reader.names}
            fmt.check(name, info["encoding"], shape, parts)
            yield name, (info["encoding"], shape, parts)
    absent = [n for n in compressed if n not in done]
    if absent:
        raise ElsaError(f"{path}: config.json lists {absent[0]} as compressed but no shard holds it; the checkpoint is incomplete")


def verify(path: str | Path) -> dict:
    """Read and check every tensor of a sparse checkpoint (no model built); returns counts per code."""
    path = Path(path)
    meta = sparse_meta(path)
    counts = {"plain": 0, fmt.BITMASK: 0, fmt.DELTA8: 0}
    for _, item in stored_tensors(path, meta):
        counts["plain" if torch.is_tensor(item) else item[0]] += 1
    return counts


def _empty_model(path: Path, dtype: torch.dtype | None):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    try:
        config = AutoConfig.from_pretrained(path)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype or getattr(config, "dtype", None) or torch.float32)
    except (ValueError, KeyError, OSError) as err:
        raise ElsaError(f"{path}: transformers cannot build a causal LM from its config.json ({str(err).splitlines()[0]})") from None
    model.tie_weights()  # no_init_weights skips init_weights, which is where transformers ties them
    return model


def from_pretrained(path: str | Path, mode: str = "dense", dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                    decode_path: str | None = None) -> torch.nn.Module:
    """A transformers causal LM from an elsa-sparse checkpoint, in eval mode on ``device``.

    ``mode="dense"``: every weight decompressed (bit for bit the dense export). ``mode="sparse"``: every compressed
    nn.Linear weight kept compressed in a SparseLinear (``decode_path``: kernel, csr or reference; default the C++
    kernel where built and the values are fp32 or bf16, else csr). ``dtype``: the stored dtype by default.
    """
    path = Path(path)
    if mode not in MODES:
        raise ElsaError(f"mode {mode!r}: choose from {', '.join(MODES)}")
    meta = sparse_meta(path)
    model = _empty_model(path, dtype)
    dtype = next(model.parameters()).dtype
    targets = model.state_dict(keep_vars=True)
    loaded: set[str] = set()
    for name, item in stored_tensors(path, meta):
        if not torch.is_tensor(item) and mode == "sparse" and _replace_linear(model, name, item, dtype, decode_path):
            loaded.add(name)
            continue
        tensor = item if torch.is_tensor(item) else fmt.decode(*item)
        _copy_into(targets, name, tensor)
        loaded.add(name)
    _check_complete(path, model, targets, loaded)
    return model.to(device).eval()


def _replace_linear(model: torch.nn.Module, name: str, item: tuple, dtype: torch.dtype, decode_path: str | None) -> bool:
    """Put a SparseLinear where ``name`` is an nn.Linear's weight; False when it is not (it is then loaded dense)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf != "weight" or not isinstance(module, torch.nn.Linear):
        return False
    encoding, shape, parts = item
    if tuple(module.weight.shape) != shape:
        raise ElsaError(f"{name}: stored shape {shape}, the model's config says {tuple(module.weight.shape)}")
    delta8 = fmt.to_delta8(encoding, shape, parts)
    delta8["values"] = delta8["values"].to(dtype)
    path = decode_path or (None if dtype in KERNEL_DTYPES else "csr")
    sparse = SparseLinear(delta8, shape, module.bias, decode_path=path, name=name)
    parent_name, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, sparse)
    return True


def _copy_into(targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    target = targets.get(name)
    if target is None:
        raise ElsaError(f"the checkpoint holds {name}, which this model (built from its config.json) does not have")
    if tuple(target.shape) != tuple(tensor.shape):
        raise ElsaError(f"{name}: stored shape {tuple(tensor.shape)}, the model's config says {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def _check_complete(path: Path, model: torch.nn.Module, targets: dict[str, torch.Tensor], loaded: set[str]) -> None:
    """Every parameter and persistent buffer got a stored value (tied weights share the one stored)."""
    filled = {id(t) for n, t in targets.items() if n in loaded}
    now = model.state_dict(keep_vars=True)
    missing = [n for n, t in now.items() if n not in loaded and id(targets.get(n, t)) not in filled and not _in_sparse(n, loaded)]
    if missing:
        raise ElsaError(f"{path}: the checkpoint lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def _in_sparse(name: str, loaded: set[str]) -> bool:
    """A SparseLinear's buffers (values, deltas, row_offsets) came from its stored weight."""
    module, _, leaf = name.rpartition(".")
    return leaf in fmt.PARTS[fmt.DELTA8] and f"{module}.weight" in loaded

