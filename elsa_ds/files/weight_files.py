"""Is a safetensors file whole? Decided from its header and its size, before anything reads a tensor from it.

A truncated download or copy, or a flipped byte in the header, otherwise fails deep inside ``from_pretrained`` (or
the warm start's mask reader) after minutes of loading, with safetensors' own error and a traceback. A shard index's
names stay inside the folder (``inside_folder``): transformers joins them onto it as given, so an absolute name or
``..`` would have it read weights from anywhere on disk; so do the folder's own files when they are links (a hub
download's links into its cache repository's ``blobs/`` excepted: ``within``).
"""
from __future__ import annotations

import os
import re
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from elsa_ds import json_data, regular_file
from elsa_ds.errors import ElsaError
from elsa_ds.files import torch_files

_HEADER_LIMIT = 100 * 2**20  # safetensors headers are small; a larger "length" means a corrupt file
# an elsa-sparse checkpoint's weight files (format version 3) and its shard index: names neither transformers (which
# reads model*.safetensors, pytorch_model*.bin) nor accelerate (which takes a folder's one *.index.json) reads
SPARSE_STEM, SPARSE_INDEX = "elsa-sparse", "elsa-sparse.shards.json"
SPARSE_CONFIG_KEY = "elsa_sparse"  # the block elsa-compress adds to a sparse checkpoint's config.json (sparse/meta.py)
SAFETENSORS_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"  # transformers' shard indexes
SHARD_INDEXES = (SAFETENSORS_INDEX, BIN_INDEX, SPARSE_INDEX)


def read_header(file: Path) -> tuple[int, Any]:
    """(header length, the header parsed) of a safetensors file; ValueError saying what is wrong when it has none.

    The header is whatever JSON the file holds (normally a dict of tensor entries): callers check its shape. A FIFO or a
    device is refused, never opened to wait on (an audit: a FIFO named zz.safetensors in a folder whose config.json says
    elsa-sparse hung the sparse-checkpoint check for good, the output's lock held)."""
    try:
        handle = regular_file.open_regular(file, follow=True)
    except regular_file.NotRegularFile as err:
        raise ValueError(err.what) from None
    with handle as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, no header")
        (length,) = struct.unpack("<Q", head)
        if length > min(_HEADER_LIMIT, size - 8):
            raise ValueError("header length beyond the end of the file")
        try:
            return length, json_data.loads(fh.read(length), unique=False)  # the safetensors library judges its header
        except ValueError:  # not JSON, not UTF-8, nested too deeply
            raise ValueError("header is not valid JSON") from None


def sparse_shards(folder: Path) -> bool:
    """Whether a safetensors file in ``folder`` carries elsa-compress's mark in its metadata: config.json's block alone
    does not say a folder is an elsa-sparse checkpoint (a dense model saved from one may carry the block)."""
    for file in sorted(folder.glob("*.safetensors")):
        try:
            _, header = read_header(file)
        except (OSError, ValueError):
            continue
        if isinstance(header, dict) and SPARSE_CONFIG_KEY in (header.get("__metadata__") or {}):
            return True
    return False


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with ``file`` as a safetensors file, in a few words; None when it is whole."""
    from safetensors import SafetensorError, safe_open

    size = file.stat().st_size
    try:
        length, header = read_header(file)
    except ValueError as err:
        return str(err)
    try:
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        expected = 8 + length + max(ends, default=0)
    except (AttributeError, KeyError, TypeError, IndexError, ValueError):
        return "header does not describe tensors"
    if expected != size:
        return f"{size:,} bytes, its header needs {expected:,}"
    try:  # safetensors' own reading of the header: dtypes, shapes against offsets, no gaps
        with safe_open(str(file), framework="pt"):
            pass
    except SafetensorError as err:
        return " ".join(str(err).split())
    return None


def stored_shapes(folder: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, file name) of every tensor in the (whole) ``*.safetensors`` files of ``folder``, from the headers."""
    found = {}
    for file in sorted(Path(folder).expanduser().glob("*.safetensors")):
        header = read_header(file)[1]
        found.update({name: (tuple(entry["shape"]), file.name) for name, entry in header.items() if name != "__metadata__"})
    return found


def check_weight_files(folder: str | Path, who: str, hub_id: str | None = None) -> None:
    """ElsaError naming the first damaged ``*.safetensors`` file of a local ``folder`` (or the file itself: a packed mask
    file), or a ``*.bin`` file no ``torch.save`` wrote, after :func:`check_model_folder` (``who``: how the message names
    the folder, e.g. ``model out/x`` or ``--init_mask out/x``); nothing for a hub id. ``hub_id``: ``folder`` is that
    model's snapshot in the Hugging Face cache, whose shards not there yet transformers downloads (those there are
    checked, and a damaged one is named with the command that fetches it again)."""
    path = Path(folder).expanduser()
    if path.is_file():
        if path.suffix == ".safetensors" and (problem := safetensors_problem(path)):
            raise ElsaError(f"{who}: {path.name} is damaged ({problem}); write or copy it again")
        return
    if not path.is_dir():
        return
    try:
        os.fspath(path).encode("utf-8")  # as the readers get it (a UTF-8 link or a relative path to such a folder loads)
    except UnicodeEncodeError:  # its files were reported damaged (safetensors' "Path ... is not valid UTF-8")
        raise ElsaError(f"{who}: its path is not valid UTF-8, and safetensors and the tokenizer cannot open files under "
                        "such a path: rename the folder (or one above it) to a UTF-8 name") from None
    check_model_folder(path, who)
    # every weight file as its reader reads it: the folder's own, and each file an index names (transformers reads a
    # shard of pytorch_model.bin.index.json with torch.load whatever its name, one of model.safetensors.index.json as
    # safetensors), so a shard under another name or in a subfolder is checked as well
    kinds = {f: "safetensors" for f in path.glob("*.safetensors")}
    kinds |= {f: "torch" for f in path.glob("*.bin") if f.is_file()}  # a FIFO or folder no index names: not read
    for file, (kind, index, shard) in indexed_shards(path).items():
        if file.exists():
            kinds.setdefault(file, kind)
        elif hub_id is None:
            raise ElsaError(f"{who}: {index} names {shard}, which the folder lacks; copy or download it again")
    for file, kind in sorted(kinds.items()):
        if (problem := _weight_file_problem(path, file, kind)) is not None:
            again = (f"the Hugging Face cache's copy ({path}): fetch it again with "
                     f"`{download_command(hub_id, str(file.relative_to(path)), '--force-download')}`" if hub_id else
                     "copy or download it again")
            raise ElsaError(f"{who}: {file.relative_to(path)} {problem}; {again}")


def indexed_shards(path: Path) -> dict[Path, tuple[str, str, str]]:
    """file -> (its kind, the index naming it, the name as given) for each shard that the index transformers reads names
    (the safetensors one where a folder has both: only its shards downloaded, ``--exclude "*.bin"``); every name of both
    indexes is checked to stay inside the folder."""
    read_by_transformers = SAFETENSORS_INDEX if (path / SAFETENSORS_INDEX).exists() else BIN_INDEX
    shards: dict[Path, tuple[str, str, str]] = {}
    for name in SHARD_INDEXES:
        if (path / name).exists():
            for shard in dict.fromkeys(read_index(path / name, ElsaError).values()):
                file = inside_folder(path, shard, path / name, ElsaError)
                if name == read_by_transformers:
                    shards.setdefault(file, ("safetensors" if name == SAFETENSORS_INDEX else "torch", name, shard))
    return shards


def _weight_file_problem(folder: Path, file: Path, kind: str) -> str | None:
    """What keeps ``file`` from being read as a ``kind`` weight file ('safetensors', 'torch'), in words after its name;
    None when it is whole. Not a regular file (a FIFO would block its reader) is a problem of its own."""
    if not file.resolve().is_file():
        return "is not a regular file"
    if kind == "safetensors":
        return None if (problem := safetensors_problem(file)) is None else f"is damaged ({problem})"
    try:
        with regular_file.open_regular(checked_target(folder, file.relative_to(folder).as_posix(), folder, ElsaError, "file")) as fh:
            zipped = torch_files.zip_problem(fh)  # transformers' torch.load would unpack a compressed entry whole
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    return None if zipped is None else f"is no file torch.save wrote ({zipped.text})"


def check_model_folder(folder: str | Path, who: str, error: type[Exception] = ElsaError) -> None:
    """What a local model ``folder`` gives every reader, its weights read or not (``--random_init`` reads only its
    config and tokenizer; ``elsa-compress`` copies its other files): no top-level link leads out of it, no JSON file
    (transformers reads each whole) is larger than any model's; ``error`` naming the file. Nothing for a hub id or a file."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return
    for entry in sorted(path.iterdir()):
        if entry.is_symlink():
            inside_folder(path, entry.name, path, error, what="file")
    for file in sorted(f for f in path.glob("*.json") if f.is_file()):
        if (size := file.stat().st_size) > json_data.MODEL_FILE_BYTES:
            raise error(f"{who}: {file.name} holds {size:,} bytes, more than any model's JSON file "
                            f"({json_data.MODEL_FILE_BYTES:,}); copy or download it again")


def read_index(index: Path, error: type[Exception], unique: bool = False) -> dict[str, str]:
    """The ``weight_map`` of a Hugging Face shard index: tensor name -> shard file name, both strings; else ``error``.
    A name given twice: the last counts, as transformers reads it (``unique``: refused, for an index elsa_ds wrote)."""
    try:
        weight_map = json_data.read(index, unique=unique)["weight_map"]
    except json_data.DuplicateKey as err:
        raise error(f"{index}: {err}") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise error(f"{index}: not a valid shard index ({type(err).__name__}: {err})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise error(f"{index}: weight_map must map tensor names to shard file names, found {str(weight_map)[:80]}")
    return weight_map


def inside_folder(folder: Path, name: str, listed_in: Path, error: type[Exception], what: str = "shard") -> Path:
    """``folder / name`` where ``name`` (a ``what`` that ``listed_in`` names) is relative, has no ``..`` and, links
    resolved, stays inside ``folder`` (a hub download's links into its cache repository's ``blobs/`` excepted:
    :func:`within`); otherwise ``error`` naming it."""
    checked_target(folder, name, listed_in, error, what)
    return folder / name


def checked_target(folder: Path, name: str, listed_in: Path, error: type[Exception], what: str = "shard") -> Path:
    """The file ``folder / name`` leads to, links resolved, checked as :func:`inside_folder` checks it: the path to open
    (without following links: one put there since is then refused, not followed)."""
    where = f"{listed_in}: {what} {name!r}"
    if not name or "\0" in name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor:
        raise error(f"{where} is not a relative file name: {what}s must lie inside {folder}")
    if ".." in PureWindowsPath(name).parts:  # splits on / and \\ alike
        raise error(f"{where} climbs out with '..': {what}s must lie inside {folder}")
    path, root = folder / name, folder.resolve()
    try:
        target = path.resolve()
    except (OSError, RuntimeError) as err:  # a link loop
        raise error(f"{where} cannot be resolved ({err})") from None
    if not within(root, target):
        raise error(f"{where} is a link to {target}, outside {folder}: {what}s must lie inside it (copy them in: cp -L)")
    return target


HUB_REPO_PREFIXES = ("models--", "datasets--")
ETAG = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a hub blob's name: the file's git sha1, or an LFS file's sha256


def within(root: Path, target: Path) -> bool:
    """Whether ``target`` (links resolved) lies inside ``root`` (resolved), or is where a Hugging Face hub download's
    links lead: a file of the ``blobs/`` of the cache repository whose snapshot ``root`` is (or lies in), or, for a
    folder outside the cache (huggingface_hub before 0.23 linked ``local_dir`` downloads' large files), a blob named by
    its etag in some cache repository's ``blobs/``. Any other file of the machine is refused however it is named."""
    if target.is_relative_to(root):
        return True
    blobs = target.parent
    if blobs.name != "blobs" or not blobs.parent.name.startswith(HUB_REPO_PREFIXES):
        return False
    snapshots = next((p for p in root.parents if p.name == "snapshots" and p.parent.name.startswith(HUB_REPO_PREFIXES)), None)
    if snapshots is not None:
        return blobs.parent == snapshots.parent
    return ETAG.fullmatch(target.name) is not None


def download_command(*args: str) -> str:
    """The hub's download command for ``args`` as the installed huggingface_hub spells it: ``hf download`` from 0.34 (its
    ``huggingface-cli`` is gone in 1.0), else ``huggingface-cli download`` (an audit, 2026-12-07: the advice named
    ``huggingface-cli``, which huggingface_hub 2.4 does not install)."""
    from importlib.metadata import version

    from packaging.version import Version

    cli = "hf" if Version(version("huggingface_hub")) >= Version("0.34") else "huggingface-cli"
    return " ".join((cli, "download", *args))
