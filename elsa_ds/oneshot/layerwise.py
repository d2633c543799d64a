"""Layer-by-layer driving of a causal LM: one decoder layer and its activations on the accelerator at a time.

The model stays in host memory. Its decoder layers are swapped for light stubs while the model's own
forward runs, so the model computes, exactly as it would, everything around the layers (embedding and
its scaling, rotary tables, the per-layer attention masks, the final norm, lm_head, logit soft-capping):

- ``capture``: the stubs record the first layer's input and every layer's keyword arguments, then stop
  the forward (nothing past the decoder stack is computed);
- ``finish``: the last stub returns hidden states computed earlier, so the model's head turns them into
  logits.

Between the two, ``run_layer`` pushes the captured activations through one real layer at a time. Every
sequence has the same length and no padding, so the keyword arguments captured for the first sequence
(masks, position embeddings) hold for all of them. That is how the one-shot methods (SparseGPT, Wanda)
calibrate through the already pruned earlier layers, and how perplexity is measured without the whole
model on the accelerator.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from elsa_ds.evaluation.perplexity import token_nll
from elsa_ds.targets import decoder_layer_list


class _Stop(Exception):
    """Raised by the last stub in capture mode: the rest of the forward is not needed."""


class _Stub(torch.nn.Module):
    """Stands in for decoder layer ``index``; the real layer is reachable but not a submodule (so ``.to`` skips it)."""

    def __init__(self, layer: torch.nn.Module, index: int, plan: _Plan):
        super().__init__()
        object.__setattr__(self, "real", layer)
        self.index, self.plan = index, plan

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # e.g. Llama's loop reads decoder_layer.attention_type
            return getattr(object.__getattribute__(self, "real"), name)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.plan.visit(self.index, hidden_states, args, kwargs)


@dataclass
class _Plan:
    """What the stubs do during one forward."""

    layers: list[torch.nn.Module]                           # the real decoder layers, in order
    home: torch.device                                      # where the model lives between uses
    mode: str = "capture"                                   # capture | finish
    inputs: list[torch.Tensor] = field(default_factory=list)
    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    final: torch.Tensor | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def visit(self, index: int, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.mode == "finish":
            if index != self.n_layers - 1:
                return hidden
            assert self.final is not None, "finish() sets final with the finish mode"
            return self.final.to(hidden.device, hidden.dtype)
        if index == 0:
            self.inputs.append(hidden.detach())
        if len(self.calls) < self.n_layers:  # the first sequence's arguments serve every sequence
            self.calls.append((args, {k: v for k, v in kwargs.items() if k != "past_key_values"}))
        if index == self.n_layers - 1:
            raise _Stop
        return hidden


@contextlib.contextmanager
def stubbed(model: torch.nn.Module, device: torch.device) -> Iterator[_Plan]:
    """Swap the decoder layers for stubs and put everything else of the model on ``device``; undone on exit."""
    layers = decoder_layer_list(model)
    real = list(layers)
    plan = _Plan(real, next(model.parameters()).device)
    for i, layer in enumerate(real):
        layers[i] = _Stub(layer, i, plan)
    try:
        model.to(device)
        yield plan
    finally:
        model.to(plan.home)
        for i, layer in enumerate(real):
            layers[i] = layer


@torch.no_grad()
def capture(model: torch.nn.Module, plan: _Plan, sequences: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The first decoder layer's inputs [n, seqlen, hidden] for ``sequences`` [n, seqlen]; fills ``plan.calls``."""
    plan.mode, plan.inputs = "capture", []
    for ids in sequences.split(1):
        try:
            model(input_ids=ids.to(device), use_cache=False)
        except _Stop:
            pass
    return torch.cat(plan.inputs)


@torch.no_grad()
def run_layer(layer: torch.nn.Module, call: tuple[tuple, dict], hidden: torch.Tensor) -> torch.Tensor:
    """Push every sequence of ``hidden`` [n, seqlen, h] through ``layer`` one at a time (the captured
    arguments are for a batch of one)."""
    args, kwargs = call
    outs = []
    for h in hidden.split(1):
        out = layer(h, *args, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return torch.cat(outs)


@torch.no_grad()
def finish(model: torch.nn.Module, plan: _Plan, sequence: torch.Tensor, last_hidden: torch.Tensor,
           device: torch.device) -> torch.Tensor:
    """Logits of one ``sequence`` [1, seqlen] whose last decoder layer produced ``last_hidden``."""
    plan.mode, plan.final = "finish", last_hidden
    logits = model(input_ids=sequence.to(device), use_cache=False).logits
    plan.mode, plan.final = "capture", None
    return logits


@torch.no_grad()
def layerwise_nll(model: torch.nn.Module, windows: torch.Tensor, device: torch.device) -> tuple[float, int]:
    """Summed next-token NLL and predicted-token count over ``windows`` [n, seqlen], one layer on ``device`` at a time."""
    model.eval()
    with stubbed(model, device) as plan:
        hidden = capture(model, plan, windows, device)
        for layer, call in zip(plan.layers, plan.calls):
            layer.to(device)
            hidden = run_layer(layer, call, hidden)
            layer.to(plan.home)
        total, count = 0.0, 0
        for ids, h in zip(windows.split(1), hidden.split(1)):
            nll, n = token_nll(finish(model, plan, ids, h, device), ids.to(device))
            total, count = total + nll, count + n
    return total, count
