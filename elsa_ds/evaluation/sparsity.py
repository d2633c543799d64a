"""Sparsity report of a saved model, read tensor by tensor from its safetensors files."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from elsa_ds.admm.projection import NM
from elsa_ds.errors import ElsaError
from elsa_ds.targets import DEFAULT_TARGETS, LayerGoal, NamePattern

NM_PATTERNS: tuple[tuple[int, int], ...] = ((2, 4), (4, 8))  # strongest first: every 2:4 mask is also a 4:8 mask


def with_patterns(wanted: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """:data:`NM_PATTERNS` and ``wanted`` (a job's own N:M, e.g. 3:4 or 1:4), strongest first: the larger share of zeros,
    then the shorter group (an audit: only 2:4 and 4:8 were tested, so a job pruned at 1:4 failed its own export's check)."""
    return tuple(sorted(set(NM_PATTERNS) | set(wanted), key=lambda nm: (-nm[0] / nm[1], nm[1])))


def nm_patterns(weight: torch.Tensor, patterns: tuple[tuple[int, int], ...] = NM_PATTERNS) -> list[str]:
    """Every "N:M" of ``patterns`` that W [out, in] satisfies: each group of M consecutive inputs of a row holds ≥ N zeros."""
    out_features, in_features = weight.shape
    zero = weight == 0
    zeros = int(zero.sum())
    found = []
    for n, m in patterns:
        if in_features % m or zeros * m < n * weight.numel():  # cannot hold: ragged groups, or too few zeros overall
            continue
        if bool((zero.reshape(out_features, in_features // m, m).sum(-1) >= n).all()):
            found.append(f"{n}:{m}")
    return found


def overall_pattern(zeros: int, per_layer: list[list[str]], patterns: tuple[tuple[int, int], ...] = NM_PATTERNS) -> str:
    """The model's pattern: dense without zeros, else the first N:M every layer satisfies, else unstructured."""
    if zeros == 0:
        return "dense"
    for n, m in patterns:
        if per_layer and all(f"{n}:{m}" in found for found in per_layer):
            return f"{n}:{m}"
    return "unstructured"


def sparsity_report(model_dir: str | Path, targets: str | None = None, patterns: tuple[tuple[int, int], ...] = NM_PATTERNS) -> dict:
    """Zeros per 2-D weight matching ``targets`` (default: decoder-layer weights) and overall, with the
    sparsity pattern (the first of ``patterns`` it holds: "2:4", "4:8"; else "unstructured" or "dense") per layer and for
    the whole model.

    Reads one tensor at a time (safetensors ``safe_open``), so a 27B export needs no 54 GB of RAM: each tensor from its own
    opening of the file, since an open file stays memory-mapped and every page read through it counts in the process's
    resident memory until it closes (a one-shot job's verify peaked at its model plus the whole file so:
    ``bench/memory.py --oneshot``).
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ElsaError(f"{model_dir}: no .safetensors files to report on")
    pattern = NamePattern(targets or DEFAULT_TARGETS)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt") as fh:
                keys = list(fh.keys())
            for key in keys:
                if _reported(key, pattern):
                    with safe_open(str(file), framework="pt") as fh:
                        yield key, fh.get_tensor(key)

    return _report(tensors(), pattern.pattern, patterns)


def model_sparsity_report(model: torch.nn.Module, targets: str | None = None, patterns: tuple[tuple[int, int], ...] = NM_PATTERNS) -> dict:
    """:func:`sparsity_report` of a model in memory (one loaded from an elsa-sparse checkpoint, whose files hold values
    and positions): its weights under the names a dense export would give them."""
    pattern = NamePattern(targets or DEFAULT_TARGETS)
    return _report(((k, t.detach()) for k, t in model.state_dict().items() if _reported(k, pattern)), pattern.pattern, patterns)


def _reported(key: str, pattern: NamePattern) -> bool:
    return key.endswith(".weight") and pattern.search(key[: -len(".weight")]) is not None


def _report(tensors: Iterable[tuple[str, torch.Tensor]], targets: str, patterns: tuple[tuple[int, int], ...] = NM_PATTERNS) -> dict:
    layers, found_nm, zeros_total, numel_total = {}, [], 0, 0
    for key, t in tensors:
        if t.dim() != 2:
            continue
        zeros = int((t == 0).sum())
        nm = nm_patterns(t, patterns) if zeros else []
        layers[key] = {"numel": t.numel(), "zeros": zeros, "sparsity": zeros / t.numel(),
                       "pattern": nm[0] if nm else ("unstructured" if zeros else "dense"), "nm": nm}
        found_nm.append(nm)
        zeros_total += zeros
        numel_total += t.numel()
    return {"layers": dict(sorted(layers.items())), "overall": zeros_total / max(numel_total, 1), "pruned_numel": numel_total,
            "pattern": overall_pattern(zeros_total, found_nm, patterns), "targets": targets}


def verified_layers(model_dir: Path, expected_zeros: dict[str, int], goals: dict[str, LayerGoal],
                    regex: str | None) -> dict[str, dict]:
    """Per pruned layer: numel, zeros, sparsity and pattern as exported; ElsaError if any layer misses its target.

    Unstructured targets need exactly the expected zero count; N:M targets need the pattern to hold in every
    group as well.
    """
    found = sparsity_report(model_dir, regex, with_patterns((g.n, g.m) for g in goals.values() if isinstance(g, NM)))["layers"]
    layers = {}
    for name, zeros in sorted(expected_zeros.items()):
        got = found.get(name)
        target = goals[name]
        if got is None or got["zeros"] != zeros:
            raise ElsaError(f"exported layer {name} has {None if got is None else got['zeros']} zeros, expected {zeros}: "
                            "export is incomplete")
        if isinstance(target, NM) and str(target) not in got["nm"]:
            raise ElsaError(f"exported layer {name} does not satisfy {target} (found {got['pattern']})")
        layers[name] = {"numel": got["numel"], "zeros": got["zeros"], "sparsity": got["sparsity"], "pattern": got["pattern"],
                        "target": str(target) if isinstance(target, NM) else target}
    return layers


def layers_summary(layers: dict[str, dict]) -> float:
    """Overall sparsity of the pruned layers."""
    return sum(v["zeros"] for v in layers.values()) / max(sum(v["numel"] for v in layers.values()), 1)
