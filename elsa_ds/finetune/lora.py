"""LoRA on the pruned layers (peft), and the merge that keeps the one-shot mask.

Each pruned W [out, in] is frozen and gets an adapter ΔW = (α / r)·B·A (A [r, in], B [out, r]; B starts at 0).
At the end the adapters are merged into the exported weights and the mask m is re-applied,

    W' = (W + (α / r)·B·A) ⊙ m,

so the export is exactly as sparse as the one-shot model (the paper's Wanda + LoRA baseline).
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch

ADAPTER = "default"
_PREFIX = "base_model.model."


def add_adapters(model: torch.nn.Module, weight_names: list[str], rank: int, alpha: float) -> torch.nn.Module:
    """The peft model with LoRA adapters on the Linears whose weights are ``weight_names`` (everything else frozen)."""
    from peft import LoraConfig, get_peft_model

    modules = sorted(name.removesuffix(".weight") for name in weight_names)
    # peft annotates lora_alpha int, but only ever divides it (lora_alpha / r): a float alpha scales as asked
    config = LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]
                        lora_dropout=0.0, bias="none", target_modules=modules)
    return get_peft_model(model, config)


def merge_adapters(state_dict: dict[str, torch.Tensor], scale: float,
                   keep_mask: Callable[[str], torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """A peft model's consolidated state dict -> the plain model's, every adapter merged: W' = (W + scale·B·A) ⊙ m.

    ``keep_mask(name)`` gives the keep-mask of the plain weight ``name`` (None: no mask, the dense control). The merge
    is computed in fp32 and stored in W's dtype.
    """
    merged: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        plain = key.removeprefix(_PREFIX)
        found = re.match(rf"^(.*)\.lora_([AB])\.{ADAPTER}\.weight$", plain)
        if found:
            adapters.setdefault(found.group(1), {})[found.group(2)] = value
            continue
        merged[plain.replace(".base_layer.", ".")] = value
    for module, ab in adapters.items():
        name = f"{module}.weight"
        merged[name] = merged_weight(merged[name], ab["A"], ab["B"], scale, keep_mask(name))
    return merged


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, keep: torch.Tensor | None) -> torch.Tensor:
    """One adapter merged: (W + scale·B·A) ⊙ m, computed in fp32, in W's dtype (``keep`` None: no mask)."""
    new = w.float() + scale * (b.float() @ a.float())
    if keep is not None:
        new = new.masked_fill(~keep.view(w.shape).to(new.device), 0.0)
    return new.to(w.dtype)


def plain_weight_name(module_name: str) -> str:
    """The plain model's weight name of a peft LoRA module's base Linear (what ``merge_adapters`` names it)."""
    return f"{module_name.removeprefix(_PREFIX)}.weight"
