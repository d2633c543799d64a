"""One sparse product for the projections that read the same input: q, k and v of an attention, gate and up of an MLP.

At batch-1 decode a pruned matrix takes a few microseconds on a GPU, and each kernel launch has a fixed cost beside
its bytes (the H200's cols16 figures fit ~3.5 µs plus ~0.4 µs a MB at 90 %: docs/results.md, section 4), which the
dense model pays too but which weighs more the fewer bytes a launch reads. Siblings read the same x, so their rows can
be one matrix: their codes concatenated row after row (each layout's rows stand alone: values and positions end to
end, the later rows' offsets shifted), one launch for all of them, each sibling's output a slice of the one product.

transformers' modules call their projections one by one (``self.q_proj(h)``, then ``self.k_proj(h)``...), so the first
sibling (the lead, a :class:`FusedLinear` holding every sibling's rows) computes the whole product and leaves it on
their shared :class:`Pending` (a plain object: torch.compile traces its attribute writes as side effects, and with no
graph break between the siblings the compiled decode step keeps the product inside its graph); each later sibling
(:class:`SiblingSlice`) takes its columns from it when it is called with the very same input tensor, and the last one
clears it. Called with another tensor, a sibling computes the product itself: never a wrong slice.

Only the siblings named in :data:`SIBLINGS`, all SparseLinear, in one layout, dtype and device, with the same input
width, under a parent of a family in :data:`FAMILIES` (its attention or MLP class, whose forward calls them in that
order on one tensor: checked for each family by tests/sparse/test_siblings.py) are grouped. Elsewhere the order or the
inputs differ (FalconH1's MLP calls up before gate; Bart's attention class is also its cross-attention), where grouping
would compute more, not less. Decode-sized products are the ungrouped model's bit for bit (each row's sum is the same);
a prefill-sized input is decompressed and multiplied densely, where a GPU's one larger GEMM may round differently from
three. A grouped model's state dict holds the lead's concatenated buffers under the lead's name and nothing under the
others': it is for decoding, not for saving (the checkpoint is the elsa-sparse folder).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from elsa_ds.sparse.format import DELTA8, MAX_COLS16
from elsa_ds.sparse.integrity import SparseArgumentError
from elsa_ds.sparse.linear import SparseLinear, gpu_layout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FUSE_ENV = "ELSA_DS_FUSE_SIBLINGS"  # 0: every projection its own launch
# (the lead, then the rest in the order the parent calls them), as transformers names them
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# transformers' families whose ``<family>Attention`` and ``<family>MLP`` call their siblings in SIBLINGS' order on their
# own input (each checked by a test: bit for bit, one product a group, nothing left pending)
FAMILIES = ("Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3", "Qwen3Moe", "Gemma", "Gemma2", "Gemma3", "Olmo", "Olmo2",
            "Granite", "Cohere", "StableLm", "Exaone4", "Starcoder2")
PARENTS = frozenset(f"{family}{kind}" for family in FAMILIES for kind in ("Attention", "MLP"))


class Pending:
    """The lead's last input and product, until the last sibling took its part (then both None)."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None


def concatenated(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The parts of the matrix whose rows are each part's rows in turn (same layout): values and positions end to end,
    each later matrix's row offsets shifted by the entries before it (its leading 0 dropped)."""
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "row_offsets"}
    offsets, base = [parts[0]["row_offsets"]], parts[0]["row_offsets"][-1]
    for p in parts[1:]:
        offsets.append(p["row_offsets"][1:] + base)
        base = base + p["row_offsets"][-1]
    out["row_offsets"] = torch.cat(offsets)
    return out


class FusedLinear(SparseLinear):
    """The lead sibling: every sibling's rows in one SparseLinear; its call returns the lead's own columns and leaves
    the whole product on ``pending`` for the others."""

    def __init__(self, siblings: list[SparseLinear]):
        lead = siblings[0]
        shape = (sum(s.out_features for s in siblings), lead.in_features)
        torch.nn.Module.__init__(self)  # the buffers come converted already: SparseLinear's delta8 check is not for cols16
        self.out_features, self.in_features = shape
        for name, tensor in concatenated([s.parts for s in siblings]).items():
            self.register_buffer(name, tensor)
        self.layout = lead.layout
        given = [s.bias for s in siblings if s.bias is not None]
        bias = torch.cat([s.bias.detach() if s.bias is not None else given[0].new_zeros(s.out_features) for s in siblings]) \
            if given else None
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self._cpu_path, self._csr = lead._cpu_path, None
        self.name, self._checked_parts = f"{lead.name} and its siblings", ((), ())  # checked as any layout at the first product
        self.own = lead.out_features       # the lead's columns: the first ``own`` of the product
        self.pending = Pending()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """Every sibling's output for ``x``, side by side."""
        return SparseLinear.forward(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        self.pending.x, self.pending.y = x, y
        return y[..., :self.own]


class SiblingSlice(torch.nn.Module):
    """A later sibling: columns ``start:stop`` of its lead's product, taken from ``pending`` when called with the lead's
    own input, else computed."""

    def __init__(self, lead: FusedLinear, start: int, stop: int, last: bool):
        super().__init__()
        self.lead = [lead]  # a list: not a child module (its buffers stay the lead's alone in the state dict)
        self.start, self.stop, self.last = start, stop, last
        self.in_features, self.out_features = lead.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = self.lead[0]
        pending = lead.pending
        y = pending.y if pending.x is x else None
        if self.last:
            pending.x = pending.y = None
        if y is None:
            y = lead.product(x)
        return y[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns {self.start}:{self.stop} of its lead's"


def fuse_siblings(model: torch.nn.Module) -> int:
    """Group every set of :data:`SIBLINGS` in ``model`` (module docstring), in place; returns how many groups."""
    groups = 0
    for parent in list(model.modules()):
        if type(parent).__name__ not in PARENTS:
            continue
        for names in SIBLINGS:
            found = [getattr(parent, n, None) for n in names]
            if not all(type(m) is SparseLinear for m in found):
                continue
            siblings: list[SparseLinear] = found  # type: ignore[assignment]
            if len({(m.layout, m.values.dtype, m.values.device, m.in_features, m.row_offsets.dtype) for m in siblings}) != 1:
                continue
            if siblings[0].row_offsets.dtype == torch.int32 and sum(m.values.numel() for m in siblings) >= 1 << 31:
                continue  # cols16's int32 offsets could not reach the later siblings' entries
            lead = FusedLinear(siblings)
            setattr(parent, names[0], lead)
            start = lead.own
            for i, (name, module) in enumerate(zip(names[1:], siblings[1:])):
                setattr(parent, name, SiblingSlice(lead, start, start + module.out_features, last=i == len(names) - 2))
                start += module.out_features
            groups += 1
    return groups


def fuse_wanted(device: torch.device) -> bool:
    """Whether a model readied for decode on ``device`` groups its siblings: on CUDA (launches are what it saves) unless
    ``ELSA_DS_FUSE_SIBLINGS=0``; on CPU when it is 1."""
    value = os.environ.get(FUSE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise SparseArgumentError(f"{FUSE_ENV}={value!r}: 1 groups the siblings' products, 0 keeps each its own")
    return value == "1" or (value == "" and device.type == "cuda")


def ready_to_decode(model: PreTrainedModel, device: torch.device) -> None:
    """For a model on ``device``: on CUDA, every SparseLinear in the GPU layout (:func:`gpu_layout`; a weight past 65536
    columns stays delta8), and a static cache for ``generate()``: transformers then compiles the decode step (mode
    reduce-overhead: one CUDA graph a step), the sparse operator inside it: no Python and no kernel launch from Python
    per layer (elsa_ds/sparse/ops.py); then the siblings grouped where :func:`fuse_wanted` says. On CPU the model is
    otherwise left as transformers makes it."""
    if device.type == "cuda":
        layout = gpu_layout()
        for module in model.modules():
            if isinstance(module, SparseLinear):
                module.to_layout(layout if module.in_features <= MAX_COLS16 else DELTA8)
        model.generation_config.cache_implementation = "static"
    if fuse_wanted(device):
        fuse_siblings(model)
