"""Which weights are pruned (``targets``: nn.Linear layers inside the decoder blocks, or a user regex over module
names) and what each is pruned to (its *goal*: a sparsity or an N:M pattern)."""
from __future__ import annotations

import math
import time

import regex as rx
import torch

from elsa_ds.admm.projection import NM, keep_count
from elsa_ds.errors import ElsaError

LayerGoal = float | NM  # what one weight is pruned to: a sparsity in [0, 1), or an N:M pattern

# Gemma/Gemma-2/Gemma-3, Llama, Mistral, Qwen2 (model.layers.N.*), OPT (model.decoder.layers.N.*) and the text decoder of
# a multimodal model (Gemma3ForConditionalGeneration: model.language_model.layers.N.*): every attention and MLP
# projection; embeddings, norms and lm_head are never inside a decoder block's Linear, and a name with a component
# starting "vision" or "audio" (model.vision_tower.encoder.layers.N.*) is never a target by default.
DEFAULT_TARGETS = r"^(?!(.*\.)?(vision|audio)[^.]*\.)(.*\.)?layers\.\d+\."


MATCH_SECONDS = 2.0  # one search of one module name (~100 characters): a pattern that takes longer is refused
TOTAL_SECONDS = 20.0  # every search of one pattern together (a model has thousands of names)


class NamePattern:
    """A regular expression over module names (``--targets``, a profile's keys: settings from files, data), searched
    by the ``regex`` module with a time limit: Python's ``re`` cannot be stopped, and a pattern that backtracks without
    end held a job at 100 % CPU with its lock (walks: ``(.|.|.)*!``, then ``(.|.){1,40}!`` and ``.*`` twelve times past
    ``settings.config_files.compile_regex``'s check). ``re``'s syntax (``regex``'s VERSION0)."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self._compiled = rx.compile(pattern, rx.VERSION0)
        self._spent = 0.0  # seconds of every search so far

    def search(self, name: str) -> rx.Match | None:
        limit = min(MATCH_SECONDS, TOTAL_SECONDS - self._spent)
        started = time.monotonic()
        try:
            return self._compiled.search(name, timeout=max(limit, 0.0))
        except TimeoutError:
            raise ElsaError(f"the regular expression {self.pattern[:200]!r} took more than {limit:g} s to match the "
                            f"module name {name[:200]!r}; write it without nested or repeated wildcards (e.g. "
                            "(q|k)_proj, layers\\.\\d+\\.)") from None
        finally:
            self._spent += time.monotonic() - started


def select_targets(model: torch.nn.Module, regex: str | None) -> dict[int, str]:
    """id(weight) -> parameter name of every nn.Linear whose module name matches ``regex``."""
    pattern = NamePattern(regex or DEFAULT_TARGETS)
    chosen = {
        id(module.weight): f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and pattern.search(name)
    }
    if not chosen:
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][:5]
        raise ElsaError(
            f"target regex {pattern.pattern!r} matches no nn.Linear module; module names look like {linears}"
        )
    return chosen


def decoder_layer_list(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ModuleList of the text decoder's layers: ``get_decoder().layers`` (``model.layers``, OPT's
    ``model.decoder.layers``, a multimodal model's ``model.language_model.layers``, never its vision tower's), else
    the first ModuleList whose entries hold parameters of more than one tensor."""
    get_decoder = getattr(model, "get_decoder", None)  # a transformers PreTrainedModel's
    decoder = get_decoder() if get_decoder is not None else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and sum(1 for _ in module[0].parameters()) > 1:
            return module
    raise ElsaError(f"{type(model).__name__}: found no list of decoder layers; layer-by-layer methods need one")


def layer_goals(shapes: dict[str, tuple[int, ...]], sparsity: float, pattern: NM | None = None,
                profile: dict[str, float] | None = None) -> dict[str, LayerGoal]:
    """What each pruned weight (``shapes``: parameter name -> full shape) is pruned to.

    An N:M ``pattern`` applies to every layer and needs in_features % M == 0. A ``profile`` maps module-name
    regexes to ratios, first match wins, unmatched layers take ``sparsity``; a regex matching no pruned
    layer is an error (a typo would silently prune at the default ratio).
    """
    if pattern is not None:
        ragged = [f"{name} {tuple(shape)}" for name, shape in shapes.items() if shape[-1] % pattern.m]
        if ragged:
            raise ElsaError(f"pattern {pattern} needs every pruned layer's input dimension divisible by {pattern.m}; "
                            f"not so for {', '.join(ragged[:3])}{' ...' if len(ragged) > 3 else ''} (narrow --targets)")
        return {name: pattern for name in shapes}
    if not profile:
        return {name: sparsity for name in shapes}
    compiled = [(NamePattern(regex), regex, ratio) for regex, ratio in profile.items()]
    unused = [regex for pat, regex, _ in compiled if not any(pat.search(module_name(n)) for n in shapes)]
    if unused:
        example = module_name(next(iter(shapes)))
        raise ElsaError(f"sparsity profile entries {unused} match no pruned layer; module names look like {example!r}")
    return {name: next((ratio for pat, _, ratio in compiled if pat.search(module_name(name))), sparsity) for name in shapes}


def goal_ratio(goal: LayerGoal) -> float:
    """The fraction of zeros a goal means (N/M for an N:M pattern)."""
    return goal.ratio if isinstance(goal, NM) else goal


def overall_ratio(goals: dict[str, LayerGoal], shapes: dict[str, tuple[int, ...]]) -> float:
    """The fraction of zeros ``goals`` make over all the weights they prune (each layer weighted by its size)."""
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    return sum(goal_ratio(goals[name]) * size for name, size in sizes.items()) / max(1, sum(sizes.values()))


def goal_zeros(numel: int, goal: LayerGoal) -> int:
    """The zeros a weight of ``numel`` entries holds once pruned to ``goal`` (exactly; N:M's N/M of them)."""
    return numel - keep_count(numel, goal_ratio(goal))


def target_shapes(model: torch.nn.Module, regex: str | None) -> dict[str, tuple[int, ...]]:
    """Each pruned weight's parameter name and full shape (``select_targets``), a tied one (lm_head) too."""
    weights = dict(model.named_parameters(remove_duplicate=False))
    return {name: tuple(weights[name].shape) for name in select_targets(model, regex).values()}


def goal_text(sparsity: float, pattern: str | None, profile: str | None) -> str:
    """What a job prunes each layer to, for its start line: the pattern, the sparsity, or a profile's ratios (never the
    sparsity alone beside a profile: it holds only where the profile names no layer)."""
    if pattern:
        return pattern
    return f"the ratios of profile {profile} ({sparsity:.0%} where it names no layer)" if profile else f"{sparsity:.0%}"


def module_name(param_name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj`` (profiles match module names)."""
    return param_name.removesuffix(".weight")
