"""The entry points' promise under damaged files: seeded truncations, byte flips and JSON type swaps of a model's
config.json, tokenizer.json and model.safetensors (a copy of the embedded demo model), of a recipe and of a DeepSpeed
JSON, each fed to ``elsa-prune`` (also as ``--init_mask``) and ``elsa-evaluate`` in this process. Each run either
works (exit 0: the corruption was harmless; a pruning job stops where its process group would start) or stops with
exit 2 and exactly one ``elsa_ds: error`` line, never a traceback, and a failed run writes nothing where its output goes.
"""
from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path
from typing import Any

from elsa_ds import cli
from elsa_ds.settings.config import DEMO_MODEL_DIR
from tests.conftest import ROOT
from tests.inprocess import demo_copy, one_line, run_main, stop_at_the_job  # noqa: F401 (a fixture)

SEED, ROUNDS = 20260427, 3
FAST = ["--dataset", "shakespeare", "--seqlen", "64", "--steps", "8", "--interval", "2", "--val_windows", "0",
        "--baseline", "none"]
RECIPE = {"source": "a test", "settings": {"sparsity": 0.5, "lr": 1e-3, "lmda": 0.01, "interval": 2, "steps": 8,
                                           "init_mask": "none", "seqlen": 64}}
SWAPS: list[Any] = ["x", 7, -1, 0, 2.5, None, True, [], {}, [1, "a"], {"k": 1}, 1e300]


# ---- the damage --------------------------------------------------------------------------------------------------------
def _truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def _flip(data: bytes, rng: random.Random, end: int | None = None) -> bytes:
    """One to four bits flipped in ``data[:end]``."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(end or len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def _swap(obj: Any, rng: random.Random) -> Any:
    """``obj`` with one value, anywhere in it, replaced by a value of another type."""
    paths: list[tuple] = []

    def walk(node: Any, path: tuple) -> None:
        paths.append(path)
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            walk(child, (*path, key))

    walk(obj, ())
    path = rng.choice(paths[1:] or paths)
    if not path:
        return rng.choice(SWAPS)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    old = parent[path[-1]]
    parent[path[-1]] = rng.choice([v for v in SWAPS if type(v) is not type(old)])
    return obj


def _damage_json(path: Path, kind: str, rng: random.Random) -> None:
    data = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(_truncate(data, rng))
    elif kind == "flip":
        path.write_bytes(_flip(data, rng))
    else:
        path.write_text(json.dumps(_swap(json.loads(data), rng)))


def _damage_safetensors(path: Path, kind: str, rng: random.Random) -> None:
    """Truncated anywhere; bits flipped in the length and header or among the weights (harmless: other weights); or one
    value of the header's JSON swapped for another type (the file rewritten with the new header's length)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    if kind == "truncate":
        path.write_bytes(_truncate(data, rng))
    elif kind == "flip":
        path.write_bytes(_flip(data, rng, end=8 + length if rng.random() < 0.5 else None))
    else:
        header = json.dumps(_swap(json.loads(data[8:8 + length]), rng)).encode()
        path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + length:])


KINDS = ("truncate", "flip", "swap")


# ---- the promise -------------------------------------------------------------------------------------------------------
def _held(code: int, err: str, written: Path, where: str) -> int:
    assert code in (0, 2), f"{where}: exit {code}\n{err[-3000:]}"
    assert "Traceback" not in err, f"{where}\n{err[-3000:]}"
    if code == 2:
        one_line(code, err)
        assert not written.exists(), f"{where}: {written} written by a failed run"
    return code


def _prune(tmp: Path, model: Path, *extra: str) -> tuple[int, str, Path]:
    out = tmp / "out"
    shutil.rmtree(out, ignore_errors=True)
    code, err, _ = run_main(cli.main_prune, ["--deepspeed", "zero3_offload", *FAST, "--model", str(model),
                                             "--output_dir", str(out), *extra])
    return code, err, out


def _evaluate(tmp: Path, model: Path) -> tuple[int, str, Path]:
    out = tmp / "result.json"
    out.unlink(missing_ok=True)
    code, err, _ = run_main(cli.main_evaluate, ["--model", str(model), "--ppl", "shakespeare", "--seqlen", "64",
                                                "--limit", "2", "--output", str(out)])
    return code, err, out


def test_damaged_model_files_give_exit_0_or_one_line(tmp_path, stop_at_the_job):
    rng, outcomes = random.Random(SEED), {0: 0, 2: 0}
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        for kind in KINDS:
            for round_ in range(ROUNDS):
                model = tmp_path / "model"
                shutil.rmtree(model, ignore_errors=True)
                demo_copy(model)
                damage = _damage_safetensors if name.endswith(".safetensors") else _damage_json
                damage(model / name, kind, rng)
                where = f"{name} {kind} #{round_}"
                outcomes[_held(*_prune(tmp_path, model), f"prune: {where}")] += 1
                outcomes[_held(*_evaluate(tmp_path, model), f"evaluate: {where}")] += 1
                if name.endswith(".safetensors"):  # the same folder as a warm start's masks
                    outcomes[_held(*_prune(tmp_path, DEMO_MODEL_DIR, "--init_mask", str(model)), f"--init_mask: {where}")] += 1
    print(f"model files (seed {SEED}): {outcomes}")
    assert outcomes[2] >= 10 and outcomes[0] >= 1, outcomes  # both sides exercised


def test_damaged_recipes_and_deepspeed_configs_give_exit_0_or_one_line(tmp_path, stop_at_the_job):
    rng, outcomes = random.Random(SEED + 1), {0: 0, 2: 0}
    recipe, ds = tmp_path / "recipe.json", tmp_path / "ds.json"
    for kind in KINDS:
        for round_ in range(ROUNDS):
            recipe.write_text(json.dumps(RECIPE))
            _damage_json(recipe, kind, rng)
            outcomes[_held(*_prune(tmp_path, DEMO_MODEL_DIR, "--recipe", str(recipe)), f"recipe {kind} #{round_}")] += 1
            shutil.copy(ROOT / "ds_configs" / "zero3_offload.json", ds)
            _damage_json(ds, kind, rng)
            outcomes[_held(*_prune(tmp_path, DEMO_MODEL_DIR, "--deepspeed", str(ds)), f"deepspeed {kind} #{round_}")] += 1
    print(f"settings files (seed {SEED + 1}): {outcomes}")
    assert outcomes[2] >= 4, outcomes
