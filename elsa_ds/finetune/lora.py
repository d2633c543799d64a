"""LoRA on the pruned layers (peft), and the merge that keeps the one-shot mask.

Each pruned W [out, in] is frozen and gets an adapter ΔW = (α / r)·B·A (A [r, in], B [out, r]; B starts at 0).
At the end the adapters are merged into the engine's base weights and the mask m is re-applied
(``zero.partitions.merge_adapters_in_place``, before the validation, so that it measures what the export holds),

    W' = (W + (α / r)·B·A) ⊙ m,

so the export is exactly as sparse as the one-shot model (the paper's Wanda + LoRA baseline).
"""
from __future__ import annotations

import re

import torch

from elsa_ds.errors import ElsaError

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


def plain_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A peft model's consolidated state dict, its adapters already merged into their base weights (B zero:
    ``zero.partitions.merge_adapters_in_place``) -> the plain model's: the adapters dropped, the base weights renamed.
    An adapter whose B is not zero was never merged: ElsaError, not an export silently without its update."""
    plain_dict: dict[str, torch.Tensor] = {}
    unmerged = []
    for key, value in state_dict.items():
        plain = key.removeprefix(_PREFIX)
        found = re.match(rf"^(.*)\.lora_([AB])\.{ADAPTER}\.weight$", plain)
        if found:
            if found.group(2) == "B" and bool(value.any()):
                unmerged.append(found.group(1))
            continue
        plain_dict[plain.replace(".base_layer.", ".")] = value
    if unmerged:
        raise ElsaError(f"LoRA adapters not merged into their base weights before the export ({len(unmerged)}, the first "
                        f"{unmerged[0]}): their update would be lost")
    return plain_dict


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, keep: torch.Tensor | None) -> torch.Tensor:
    """One adapter merged: (W + scale·B·A) ⊙ m, computed in fp32, in W's dtype (``keep`` None: no mask)."""
    new = w.float() + scale * (b.float() @ a.float())
    if keep is not None:
        new = new.masked_fill(~keep.view(w.shape).to(new.device), 0.0)
    return new.to(w.dtype)


def plain_weight_name(module_name: str) -> str:
    """The plain model's weight name of a peft LoRA module's base Linear (what ``plain_state_dict`` names it)."""
    return f"{module_name.removeprefix(_PREFIX)}.weight"
