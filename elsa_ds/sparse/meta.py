"""The ``elsa_sparse`` block of a sparse checkpoint's config.json: written sealed with its checksums, read back checked.

    "elsa_sparse": {"format": "elsa-sparse", "version": 3, "min_sparsity": 0.3,
                    "tensors": {NAME: {"shape": [rows, cols], "dtype", "encoding", "nonzeros", "entries"}},
                    "checksum": {"algorithm": "sha256", "tensors": {STORED_NAME: hex}, "config": hex}}

Version 1 (before checksums) still loads, unverified, with a warning. Every problem with the block, the config.json
around it or the JSON itself is one SparseCheckpointError naming the file and the entry.
"""
from __future__ import annotations

from pathlib import Path

from elsa_ds import json_data
from elsa_ds.files.safetensors_writer import DTYPES
from elsa_ds.files.weight_files import SPARSE_CONFIG_KEY, check_model_folder
from elsa_ds.log import get_logger
from elsa_ds.sparse import format as fmt
from elsa_ds.sparse.integrity import ALGORITHM, SparseCheckpointError, is_digest, json_digest

CONFIG_KEY = SPARSE_CONFIG_KEY
UNSEALED_VERSION = 1  # written before checksums: loaded unverified
MODEL_NAMED_VERSIONS = (UNSEALED_VERSION, 2)  # weights in model.safetensors, which transformers loads without the block
READABLE_VERSIONS = (*MODEL_NAMED_VERSIONS, fmt.VERSION)
FLOAT_DTYPES = {str(d).removeprefix("torch."): d for d in DTYPES if d.is_floating_point}  # what compress can write

log = get_logger(__name__)


def read_config(folder: Path) -> dict:
    """The folder's config.json as a dict; SparseCheckpointError when it is missing, not JSON or not an object."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise SparseCheckpointError(f"{folder}: no such folder{' (it is a file)' if folder.exists() else ''}; "
                                    "pass the folder elsa-compress or --export_format sparse wrote")
    if not path.is_file():
        raise SparseCheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = json_data.read(path, unique=False)  # as transformers reads a model's config (a key twice: the last)
    except OSError as err:
        raise SparseCheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:  # UnicodeDecodeError, too large and nested too deeply included
        raise SparseCheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise SparseCheckpointError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def block(min_sparsity: float, chosen: dict[str, dict], digests: dict[str, str]) -> dict:
    """The block ``compress`` writes: each compressed weight's entry and every stored tensor's digest."""
    tensors = {n: {k: v for k, v in c.items() if k not in ("dense_bytes", "bytes")} for n, c in chosen.items()}
    return {"format": fmt.FORMAT, "version": fmt.VERSION, "min_sparsity": min_sparsity, "tensors": tensors,
            "checksum": {"algorithm": ALGORITHM, "tensors": digests, "config": ""}}


def elsa_named(meta: dict) -> bool:
    """Whether a checkpoint's weight files are ``elsa-sparse.safetensors`` (sharded: ``elsa-sparse-*.safetensors`` and
    ``elsa-sparse.shards.json``), where ``transformers.from_pretrained`` finds no weights and fails, instead of building
    the pruned ones at random beside the ``NAME.values`` it does not know: format version 3; versions 1 and 2 used
    transformers' names."""
    return meta["version"] not in MODEL_NAMED_VERSIONS


def config_digest(config: dict) -> str:
    """The digest of a whole config.json with the block's own ``checksum.config`` left empty."""
    meta = config[CONFIG_KEY]
    return json_digest({**config, CONFIG_KEY: {**meta, "checksum": {**meta["checksum"], "config": ""}}})


def seal(config: dict) -> dict:
    """``config`` (its block from :func:`block`) with the digest of the whole of it filled in."""
    config[CONFIG_KEY]["checksum"]["config"] = config_digest(config)
    return config


def sparse_meta(path: Path, verify: bool = True) -> dict:
    """The checkpoint's ``elsa_sparse`` block, checked entry by entry, and (``verify``) config.json against its digest.

    SparseCheckpointError for a dense folder, an unknown format version or anything malformed.
    """
    check_model_folder(path, str(path), SparseCheckpointError)  # config.json, the index: no link leads out of the folder
    config = read_config(path)
    meta = config.get(CONFIG_KEY)
    where = f"{path / 'config.json'}: {CONFIG_KEY}"
    if meta is None:
        raise SparseCheckpointError(f"{path} is not an elsa-sparse checkpoint (its config.json has no {CONFIG_KEY!r}); "
                                    "load a dense folder with transformers' from_pretrained, or make a sparse one with elsa-compress")
    if not isinstance(meta, dict) or meta.get("format") != fmt.FORMAT or not isinstance(meta.get("tensors"), dict):
        raise SparseCheckpointError(f"{path}: config.json's {CONFIG_KEY!r} is not an {fmt.FORMAT} block")
    version = meta.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise SparseCheckpointError(f"{path}: {fmt.FORMAT} format version {version!r}; this elsa_ds reads versions "
                                    f"{', '.join(map(str, READABLE_VERSIONS))} (upgrade elsa_ds, or compress the dense model again)")
    for name, info in meta["tensors"].items():
        _check_entry(f"{where}.tensors[{name!r}]", info)
    if version == UNSEALED_VERSION:
        if "checksum" in meta:  # version 1 never wrote one: the version was changed
            raise SparseCheckpointError(f"{where}: version 1 with a checksum block; the version was edited or corrupted")
        if verify:
            log.warning("%s: format version %d records no checksums, so it is loaded unverified "
                        "(compress the dense model again to record them)", path, version)
        return meta
    _check_checksum_block(f"{where}.checksum", meta.get("checksum"))
    if verify and meta["checksum"]["config"] != config_digest(config):
        raise SparseCheckpointError(f"{path / 'config.json'}: does not match the checksum recorded when it was written: "
                                    "it was edited or corrupted (compress the model again; verify=False skips the checks)")
    return meta


def _check_entry(where: str, info: object) -> None:
    if not isinstance(info, dict):
        raise SparseCheckpointError(f"{where}: expected an object, found {type(info).__name__}")
    shape = info.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n > 0 for n in shape)):
        raise SparseCheckpointError(f"{where}.shape: expected [rows, cols] of positive integers, found {shape!r}")
    if not isinstance(info.get("encoding"), str) or info["encoding"] not in fmt.PARTS:
        raise SparseCheckpointError(f"{where}.encoding: {info.get('encoding')!r} is not one of {', '.join(fmt.PARTS)}")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in FLOAT_DTYPES:
        raise SparseCheckpointError(f"{where}.dtype: {dtype!r} is not one of {', '.join(FLOAT_DTYPES)}")
    for key in ("nonzeros", "entries"):
        if type(info.get(key)) is not int or info[key] < 0:
            raise SparseCheckpointError(f"{where}.{key}: expected a count, found {info.get(key)!r}")


def _check_checksum_block(where: str, checksum: object) -> None:
    if not isinstance(checksum, dict):
        raise SparseCheckpointError(f"{where}: missing or not an object ({fmt.FORMAT} version {fmt.VERSION} records checksums)")
    if checksum.get("algorithm") != ALGORITHM:
        raise SparseCheckpointError(f"{where}.algorithm: {checksum.get('algorithm')!r}; this elsa_ds checks {ALGORITHM!r}")
    digests = checksum.get("tensors")
    if not isinstance(digests, dict) or not all(is_digest(d) for d in digests.values()):
        raise SparseCheckpointError(f"{where}.tensors: expected an object of {ALGORITHM} hex digests by stored tensor name")
    if not is_digest(checksum.get("config")):
        raise SparseCheckpointError(f"{where}.config: expected the {ALGORITHM} hex digest of config.json")
