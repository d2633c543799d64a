"""The sparse checkpoint reader under seeded damage: files cut short, bytes flipped, JSON values swapped for another
type. Every case either raises exactly SparseCheckpointError (one line) or loads the very model that was written;
any other exception, or a different model, fails. A flipped byte in a shard's tensor data is always refused."""
from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch

from elsa_ds.sparse import SparseCheckpointError, from_pretrained, verify
from tests.sparse.conftest import SPARSE_INDEX, SPARSE_SHARDS

SEED = 20240542
FLIPS_PER_FILE = 8
SWAPS = (None, "x", 1.5, -3, [], {}, [16, "16"], {"a": 1}, True)
INDEX = SPARSE_INDEX


@pytest.fixture(scope="module")
def work(tiny_sparse_dir, tmp_path_factory):
    """A copy to damage, one file at a time (each case restores what it changed), and what a clean load gives."""
    ckpt = tmp_path_factory.mktemp("fuzz") / "ckpt"
    shutil.copytree(tiny_sparse_dir, ckpt)
    reference = {mode: _state(from_pretrained(ckpt, mode=mode)) for mode in ("dense", "sparse")}
    return ckpt, reference, verify(ckpt)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _files(ckpt: Path) -> list[Path]:
    return [ckpt / "config.json", ckpt / INDEX] + sorted(ckpt.glob(SPARSE_SHARDS))


def _outcome(work, label: str, mode: str, check: bool = True) -> str:
    """'refused' (exactly SparseCheckpointError, one line) or 'loaded' (the reference model); anything else fails."""
    ckpt, reference, counts = work
    try:
        state = _state(from_pretrained(ckpt, mode=mode, verify=check))
    except SparseCheckpointError as err:
        assert type(err) is SparseCheckpointError and "\n" not in str(err), f"{label}: {err!r}"
        return "refused"
    except Exception as err:  # noqa: BLE001 - the point: no other exception type may escape
        pytest.fail(f"{label} ({mode}, verify={check}): {type(err).__name__}: {err}")
    assert state.keys() == reference[mode].keys(), f"{label}: loaded other tensors"
    changed = [k for k, t in state.items() if not torch.equal(t, reference[mode][k])]
    assert not changed, f"{label} ({mode}, verify={check}): loaded a different model ({changed[:3]})"
    return "loaded"


def _verify_outcome(work, label: str) -> str:
    ckpt, _, counts = work
    try:
        found = verify(ckpt)
    except SparseCheckpointError:
        return "refused"
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"{label} (verify): {type(err).__name__}: {err}")
    assert found == counts, label
    return "loaded"


def _data_start(shard: Path) -> int:
    """Where a safetensors file's tensor bytes begin: after the 8-byte header length and the JSON header."""
    return 8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]


def test_truncated_files(work):
    ckpt = work[0]
    for path in _files(ckpt):
        data = path.read_bytes()
        for keep in sorted({0, 1, 7, 8, 9, len(data) // 3, len(data) // 2, len(data) - 2, len(data) - 1}):
            path.write_bytes(data[:keep])
            try:
                label = f"{path.name} cut to {keep} of {len(data)} bytes"
                got = _outcome(work, label, "sparse" if keep % 2 else "dense")
                assert got == "refused" or path.suffix == ".json", label  # a safetensors file is never short
                assert _verify_outcome(work, label) == got, label
            finally:
                path.write_bytes(data)


def test_flipped_bytes(work):
    rng = random.Random(SEED)
    ckpt, outcomes = work[0], []
    for path in _files(ckpt):
        data = path.read_bytes()
        start = _data_start(path) if path.suffix == ".safetensors" else len(data)
        for i, at in enumerate(sorted(rng.sample(range(len(data)), FLIPS_PER_FILE))):
            flipped = bytearray(data)
            flipped[at] ^= rng.randrange(1, 256)
            path.write_bytes(bytes(flipped))
            try:
                label = f"{path.name} byte {at} of {len(data)} flipped to {flipped[at]:#04x}"
                got = _outcome(work, label, ("dense", "sparse")[i % 2])
                assert got == "refused" or at < start, f"{label}: a flip in tensor data loaded"
                assert _verify_outcome(work, label) == got, label
                outcomes.append(got)
            finally:
                path.write_bytes(data)
    assert outcomes.count("refused") > len(outcomes) // 2  # most flips change something; none slips through


def _paths(node, prefix=()):
    """Every key path into a JSON value (containers and leaves), depth first."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


def _swapped(payload, path, value):
    payload = json.loads(json.dumps(payload))
    node = payload
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return payload


@pytest.mark.parametrize("check", [True, False], ids=["verify", "unverified"])
def test_json_values_of_another_type(work, check):
    """Each entry of the elsa_sparse block and the shard index (and, checked, of the model's config) swapped for a
    value of another type; unverified, a field the loader does not read may load the same model."""
    rng = random.Random(SEED)
    ckpt = work[0]
    for path in (ckpt / "config.json", ckpt / INDEX):
        text = path.read_text()
        payload = json.loads(text)
        keys = [p for p in _paths(payload) if p and (check or path.name == INDEX or p[0] == "elsa_sparse")]
        for i, key in enumerate(keys):
            current = _get(payload, key)
            value = rng.choice([v for v in SWAPS if type(v) is not type(current)])
            path.write_text(json.dumps(_swapped(payload, key, value)))
            try:
                _outcome(work, f"{path.name}: {'.'.join(map(str, key))} = {value!r}", ("dense", "sparse")[i % 2], check)
            finally:
                path.write_text(text)


def _get(payload, key):
    for k in key:
        payload = payload[k]
    return payload
