"""What the sparse readers refuse and how they know: the error types of ``elsa_ds.sparse`` and the checksums.

Format version 2 records a SHA-256 per stored tensor (its name, dtype and shape, then its bytes) and one of
config.json itself (its canonical JSON with that digest left out): a flipped byte in the weights, the positions or
the config (a bitmask bit moved with the count unchanged included) is refused instead of loading another model.
SHA-256 over blake2b: with the CPU's SHA extensions it hashes about twice as fast.
"""
from __future__ import annotations

import hashlib
import json
import re

import torch

from elsa_ds.errors import ElsaError

ALGORITHM = "sha256"


class SparseCheckpointError(ElsaError, ValueError):
    """A folder the sparse readers take (an elsa-sparse checkpoint, or the pruned model ``compress`` reads) that is not
    what it claims; the message names the file and what is wrong. A ValueError for the API, an ElsaError for the CLI."""


class SparseArgumentError(ElsaError, ValueError):
    """An argument of ``compress``, ``from_pretrained`` or ``verify`` with a value they cannot take."""


class SparseArgumentTypeError(ElsaError, TypeError):
    """An argument of ``compress``, ``from_pretrained`` or ``verify`` of the wrong type."""


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    """SHA-256 of a stored tensor: its name, dtype and shape (a renamed or retyped tensor differs), then its bytes."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    h = hashlib.new(ALGORITHM, f"{name}\0{dtype}\0{list(tensor.shape)}\0".encode())
    data = tensor.detach().cpu().reshape(-1).contiguous()
    if data.numel():
        h.update(data.view(torch.uint8).numpy().data)  # its memoryview: numpy's stubs give ndarray __buffer__ on 3.12+ only
    return h.hexdigest()


def json_digest(payload: object) -> str:
    """SHA-256 of ``payload``'s canonical JSON (sorted keys, no spaces): the same for any layout of the same content."""
    return hashlib.new(ALGORITHM, json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def is_digest(text: object) -> bool:
    """A hex digest of ALGORITHM, as :func:`tensor_digest` and :func:`json_digest` write them."""
    return isinstance(text, str) and re.fullmatch(f"[0-9a-f]{{{2 * hashlib.new(ALGORITHM).digest_size}}}", text) is not None


def check_type(name: str, value: object, types: type | tuple[type, ...], what: str) -> None:
    """SparseArgumentTypeError unless ``value`` is one of ``types`` (a bool is not taken for a number)."""
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise SparseArgumentTypeError(f"{name}={value!r}: expected {what}, got {type(value).__name__}")
