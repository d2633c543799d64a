"""Convert a pruned HF model folder into an elsa-sparse checkpoint, one tensor at a time.

Two passes over the input: the first decides each tensor's code and so its stored shapes (the shard headers are
fixed before any data exists, as in the dense export); the second encodes and streams each tensor into its shard.
The output is built in a hidden staging folder beside ``dst`` and renamed into place when complete.
"""
from __future__ import annotations

import math
import numbers
import os
import shutil
from pathlib import Path

import torch

from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import DiskFull, disk_full, existing_ancestor
from elsa_ds.files.io import write_json
from elsa_ds.files.marks import not_replaced, note_entries
from elsa_ds.files.mounts import mount_problem
from elsa_ds.files.output import fresh_staging, publish
from elsa_ds.files.ownership import check_apart, owned
from elsa_ds.regular_file import open_regular
from elsa_ds.files.weight_files import SPARSE_INDEX, SPARSE_STEM, check_model_folder, checked_target
from elsa_ds.files.safetensors_writer import DEFAULT_MAX_SHARD_SIZE, ShardedWriter, TensorSpec, parse_size
from elsa_ds.sparse import format as fmt
from elsa_ds.sparse.folder import TensorReader, is_weight_file
from elsa_ds.sparse.integrity import SparseArgumentError, SparseCheckpointError, check_type, tensor_digest
from elsa_ds.sparse.meta import CONFIG_KEY, block, read_config, seal

DEFAULT_MIN_SPARSITY = 0.3
ANOTHER_OUTPUT = "choose another output folder"  # what a message of a full disk tells the user to do instead
MODEL_CARD = "README.md"  # transformers' own error in this folder names no way out: the card says how to load it
CARD_BYTES = 1 << 20  # an input's own card is text (a hub model's: a few KiB); past this it is not one
CARD_TEXT = """{heading} An elsa-sparse checkpoint

A pruned model stored as {fmt} version {version}: each of its {count} compressed weights as its nonzero values and their
positions, in files transformers does not read (`AutoModelForCausalLM.from_pretrained` stops here with "no file named
model.safetensors"; `AutoConfig` and `AutoTokenizer` read the folder as usual). Load it with elsa_ds:

    import elsa_ds.sparse
    model = elsa_ds.sparse.from_pretrained("PATH", mode="dense")   # a plain transformers model, weights decompressed
    model = elsa_ds.sparse.from_pretrained("PATH", mode="sparse")  # the pruned Linears kept compressed (less memory)

Either model's `save_pretrained(DIR)` writes the dense model, which transformers reads. `elsa-compress --verify PATH`
checks every tensor against its SHA-256 in config.json.
"""


def check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    """Cheap checks before any work: the input is a folder, the output is free (or --overwrite) and apart from it; what
    it holds now is what the publication may replace (``note_entries``)."""
    if not src.is_dir():
        raise SparseArgumentError(f"input {src} is not a folder")
    check_model_folder(src, f"input {src}", SparseCheckpointError)  # no link out of it: its other files are copied
    try:
        check_apart(dst, "output", {"": src})
    except ElsaError as err:  # the API's contract: a ValueError
        raise SparseArgumentError(str(err)) from None
    if dst.exists() and not dst.is_dir():
        raise SparseArgumentError(f"output {dst} exists and is not a folder")
    if dst.is_dir() and (refusal := not_replaced(dst, "output", overwrite)):
        raise SparseArgumentError(refusal)
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise SparseArgumentError(f"output {dst} is not empty; pass --overwrite to replace it, or choose another folder")
    if why := mount_problem(dst, "output", replaced=True):  # an audit: compressed whole, then its rename failed
        raise SparseArgumentError(why)
    note_entries(dst)


def check_room(dst: Path, needed: int) -> None:
    """DiskFull before any write when the file system that will hold ``dst`` has less than ``needed`` bytes free (the
    stored tensors and copied files; the previous output, with --overwrite, stays until the new one is complete)."""
    if needed > shutil.disk_usage(existing_ancestor(dst)).free:
        raise DiskFull(dst, needed, fix=ANOTHER_OUTPUT)


def _plan(reader: TensorReader, min_sparsity: float) -> tuple[list[TensorSpec], dict[str, dict]]:
    """Every stored tensor's spec, and for each weight to compress its code, shape, dtype and counts."""
    specs, chosen = [], {}
    for name, tensor in reader.items():
        if not fmt.compressible(tensor, min_sparsity):
            specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype))
            continue
        rows, cols = tensor.shape
        nonzeros, entries = fmt.counts(tensor)
        sizes = fmt.code_bytes((rows, cols), tensor.element_size(), nonzeros, entries)
        encoding = fmt.pick(sizes)
        count = nonzeros if encoding == fmt.BITMASK else entries
        specs.append(TensorSpec(f"{name}.values", (count,), tensor.dtype))
        if encoding == fmt.BITMASK:
            specs.append(TensorSpec(f"{name}.bitmask", (rows, math.ceil(cols / 8)), torch.uint8))
        else:
            specs += [TensorSpec(f"{name}.deltas", (count,), torch.uint8), TensorSpec(f"{name}.row_offsets", (rows + 1,), torch.int64)]
        chosen[name] = {"shape": [rows, cols], "dtype": str(tensor.dtype).removeprefix("torch."), "encoding": encoding,
                        "nonzeros": nonzeros, "entries": count, "dense_bytes": tensor.numel() * tensor.element_size(),
                        "bytes": sizes[encoding]}
    return specs, chosen


def _write(reader: TensorReader, out: Path, specs: list[TensorSpec], chosen: dict[str, dict], max_shard_size) -> dict[str, str]:
    """Stream every tensor into the shards; returns each stored tensor's digest."""
    digests = {}
    metadata = {"format": "pt", CONFIG_KEY: str(fmt.VERSION)}
    with ShardedWriter(out, specs, max_shard_size, metadata=metadata, stem=SPARSE_STEM, index=SPARSE_INDEX) as writer:
        for name, tensor in reader.items():
            if name in chosen:
                encoded = fmt.encode(tensor, chosen[name]["encoding"])
                stored = {f"{name}.{part}": encoded.parts[part] for part in fmt.PARTS[encoded.encoding]}
            else:
                stored = {name: tensor}
            for key, t in stored.items():
                writer.write(key, t)
                digests[key] = tensor_digest(key, t)
    return digests


def check_arguments(src: str | Path, dst: str | Path, min_sparsity: float, max_shard_size: int | str, overwrite: bool) -> None:
    """Wrong types and values as one line each (SparseArgumentTypeError / SparseArgumentError), before any work (typed as
    ``compress`` declares them: the checks are for callers that ignore the declaration)."""
    for label, value in (("src", src), ("dst", dst)):
        check_type(label, value, (str, os.PathLike), "a folder path (str or Path)")
    check_type("min_sparsity", min_sparsity, numbers.Real, "a fraction in (0, 1]")
    check_type("max_shard_size", max_shard_size, (int, str), "a number of bytes or a size such as '5GB'")
    check_type("overwrite", overwrite, bool, "True or False")
    if not 0.0 < min_sparsity <= 1.0:
        raise SparseArgumentError(f"min_sparsity {min_sparsity}: expected a fraction in (0, 1]")
    parse_size(max_shard_size)  # "5XB": one line now, not after the input is read


def compress(src: str | Path, dst: str | Path, min_sparsity: float = DEFAULT_MIN_SPARSITY,
             max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False) -> dict:
    """Write ``src`` (a pruned HF model folder) to ``dst`` as an elsa-sparse checkpoint; returns what it stored.

    Every 2-D floating tensor with at least ``min_sparsity`` zeros is stored as values + positions (the smaller of
    bitmask and delta8); everything else as it was. Other files of ``src`` (tokenizer, generation config) are copied;
    its README.md (the input's own, or a new one) says how to load the checkpoint.
    """
    check_arguments(src, dst, min_sparsity, max_shard_size, overwrite)
    src, dst = Path(src), Path(dst)
    check_paths(src, dst, overwrite)
    config = read_config(src)
    if CONFIG_KEY in config:
        raise SparseArgumentError(f"{src} is already an elsa-sparse checkpoint (config.json has {CONFIG_KEY!r})")
    copied = [f for f in src.iterdir() if f.is_file() and f.name != "config.json" and not is_weight_file(f)]
    own = own_card(src, copied)
    read_card(src, own)  # refused now, before the weights are read, if it is not a model card
    copied = [f for f in copied if f is not own]
    reader = TensorReader(src)
    specs, chosen = _plan(reader, min_sparsity)
    if not chosen:
        raise SparseArgumentError(f"{src}: no 2-D weight has {min_sparsity:.0%} or more zeros, so nothing would get smaller; "
                                  "is this the pruned model? (lower --min_sparsity to compress less sparse weights)")
    with owned(dst, "output"):
        check_paths(src, dst, overwrite)  # again, now that no other job can write dst
        card_name, card = model_card(own, read_card(src, own), len(chosen))  # read once more: what was checked is what is written
        check_room(dst, sum(spec.nbytes for spec in specs) + sum(f.stat().st_size for f in copied) + len(card))
        staging = fresh_staging(dst)
        try:
            digests = _write(reader, staging, specs, chosen, max_shard_size)
            for f in copied:
                shutil.copy2(f, staging / f.name)
            (staging / card_name).write_bytes(card)
            config[CONFIG_KEY] = block(min_sparsity, chosen, digests)
            write_json(staging / "config.json", seal(config))
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            if (full := disk_full(err, staging)) is not None:  # its free space measured with the partial files gone
                raise full.measured_again(fix=ANOTHER_OUTPUT) from None
            raise
        publish(staging, dst, keep_checkpoints=False, carry=())
    return summary(src, dst, chosen)


def own_card(src: Path, files: list[Path]) -> Path | None:
    """The input's own model card among ``files``: README.md itself where there is one (the file the hub shows), else the
    one file named so in another case; several such without README.md are refused (which to extend would be a guess)."""
    cards = sorted(f for f in files if f.name.lower() == MODEL_CARD.lower())
    if len(cards) > 1 and not any(f.name == MODEL_CARD for f in cards):
        raise SparseCheckpointError(f"{src}: {len(cards)} model cards ({', '.join(f.name for f in cards)}): keep one, "
                                    f"named {MODEL_CARD}")
    return next((f for f in cards if f.name == MODEL_CARD), cards[0] if cards else None)


def read_card(src: Path, own: Path | None) -> bytes | None:
    """The input's own card's bytes (None without one), read once without following a link at its name and inside ``src``,
    at most :data:`CARD_BYTES`; a card that is larger or not UTF-8 text refused (SparseCheckpointError), as a link to a
    weight file would be."""
    if own is None:
        return None
    target = checked_target(src, own.name, src, SparseCheckpointError, "model card")
    try:
        with open_regular(target) as fh:
            text = fh.read(CARD_BYTES + 1)
    except OSError as err:  # NotRegularFile too
        raise SparseCheckpointError(f"{own}: cannot be read as the model card ({err})") from None
    if len(text) > CARD_BYTES:
        raise SparseCheckpointError(f"{own}: more than {CARD_BYTES:,} bytes, not a model card (text of a few KiB); "
                                    f"remove it or make it the card, then compress again")
    try:
        text.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SparseCheckpointError(f"{own}: not UTF-8 text ({err.reason} at byte {err.start}), and the card's own "
                                    "section is appended in UTF-8; convert it (iconv -t UTF-8) or remove it") from None
    return text


def model_card(own: Path | None, text: bytes | None, compressed: int) -> tuple[str, bytes]:
    """The checkpoint's README: the input's own card ``own`` (its bytes ``text``, as :func:`read_card` read them) with how
    to load this checkpoint after it, or that alone. Returns (file name, bytes)."""
    heading = "##" if own is not None else "#"
    ours = CARD_TEXT.format(heading=heading, fmt=fmt.FORMAT, version=fmt.VERSION, count=compressed).encode()
    if own is None or text is None:
        return MODEL_CARD, ours
    return own.name, text + (b"" if text.endswith(b"\n") or not text else b"\n") + b"\n" + ours


def summary(src: Path, dst: Path, chosen: dict[str, dict]) -> dict:
    """Bytes of the compressed weights before and after, and of the weight files on disk."""
    def on_disk(folder: Path) -> int:
        return sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and is_weight_file(f))

    return {"tensors": chosen, "pruned_dense_bytes": sum(c["dense_bytes"] for c in chosen.values()),
            "pruned_bytes": sum(c["bytes"] for c in chosen.values()), "input_bytes": on_disk(src), "output_bytes": on_disk(dst)}
