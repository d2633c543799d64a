"""A model as the memory estimator and the pre-flight checks see it: parameter counts by role, read from a
meta-device instance built from the config alone (no weights), and the checks that need only those shapes."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elsa_ds.data.hub_texts import hub_unreachable
from elsa_ds.errors import ElsaError
from elsa_ds.models import SHIPPED_CONFIGS, embedding_weights, meta_model, shipped_config
from elsa_ds.targets import decoder_layer_list, select_targets
from elsa_ds.zero.ds_config import param_buffer_size


@dataclass
class ModelShape:
    """What the estimator needs to know of a model (exact counts from a meta-device instance)."""

    num_params: int
    pruned_params: int
    hidden: int
    layers: int
    heads: int
    vocab: int
    largest_layer_params: int
    largest_param: int
    largest_pruned_param: int = 0
    # (numel, pruned) of every trained parameter in the optimizer's order (model.parameters()): ZeRO-3's sub-groups
    params: list[tuple[int, bool]] = field(default_factory=list)
    # numel of every frozen parameter (--freeze_embeddings): stored, gathered and swapped, never stepped
    frozen: list[int] = field(default_factory=list)
    # (numel, pruned) of every parameter in state-dict order (the export's shards), and the numel of tied duplicates
    order: list[tuple[int, bool]] = field(default_factory=list)
    tied: int = 0
    layer_tensors: int = 0  # parameter tensors inside the decoder layers (--leaf_layers hooks each layer, not these)

    @property
    def trainable_params(self) -> int:
        return self.num_params - sum(self.frozen)


def resolve_model_config(model: str):
    """A transformers config from a directory, a config.json, a shipped config, or the hub (in that order)."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if path.is_file():
        path = path.parent
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ElsaError(f"{model}: directory has no config.json")
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    if (shipped := shipped_config(model)) is not None:
        return AutoConfig.from_pretrained(shipped.parent, trust_remote_code=False)
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=False, local_files_only=True)  # the hub's cache
    except OSError:
        cached = "not in the Hugging Face cache"
    except ValueError as err:
        cached = f"not usable from the Hugging Face cache ({str(err).splitlines()[0]})"
    ids = sorted(str(c.parent.relative_to(SHIPPED_CONFIGS)) for c in SHIPPED_CONFIGS.glob("*/*/config.json"))
    near = difflib.get_close_matches(model, ids, n=3, cutoff=0.6)
    where = (f"not a directory, not shipped in {SHIPPED_CONFIGS}" + (f" (did you mean {' or '.join(near)}?)" if near else
             f" (shipped: {', '.join(ids)})"))
    if (offline := hub_unreachable()) is not None:  # say so now, not after the hub client's retries (~25 s)
        raise ElsaError(f"cannot resolve model {model!r}: {where}, {cached}, and {offline}")
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ElsaError(f"cannot resolve model {model!r}: {where}, and not loadable ({str(err).splitlines()[0]})") from None


def model_shape(config, targets: str | None = None, model: torch.nn.Module | None = None,
                freeze_embeddings: bool = False) -> ModelShape:
    """Exact parameter counts from a meta-device instance of the architecture (no weights, no memory); trained are the
    parameters that require a gradient, less the embeddings with ``freeze_embeddings`` (``model`` is not changed)."""
    model = model if model is not None else meta_model(config)
    frozen_ids = {id(w) for w in embedding_weights(model)} if freeze_embeddings else set()
    trained = {id(p) for p in model.parameters() if p.requires_grad and id(p) not in frozen_ids}
    pruned_ids = select_targets(model, targets)
    layers = decoder_layer_list(model)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    text = getattr(config, "text_config", config)
    return ModelShape(
        num_params=sum(p.numel() for p in model.parameters()),
        pruned_params=sum(p.numel() for p in model.parameters() if id(p) in pruned_ids),
        hidden=text.hidden_size, layers=text.num_hidden_layers, heads=text.num_attention_heads,
        vocab=text.vocab_size, largest_layer_params=max(per_layer) if per_layer else 0,
        largest_param=max(p.numel() for p in model.parameters()),
        largest_pruned_param=max((p.numel() for p in model.parameters() if id(p) in pruned_ids), default=0),
        params=[(p.numel(), id(p) in pruned_ids) for p in model.parameters() if id(p) in trained],
        frozen=[p.numel() for p in model.parameters() if id(p) not in trained],
        order=[(p.numel(), id(p) in pruned_ids) for p in model.parameters()],
        tied=sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False)) - sum(p.numel() for p in model.parameters()),
        layer_tensors=sum(1 for _ in layers.parameters()),
    )


def state_bytes(shape: ModelShape, half: int = 2, z_bytes: int = 4, u_bytes: int = 4) -> float:
    """ZeRO-3's state of a model: 16-bit parameters, gradients, fp32 masters, Adam moments and z, u of the trained
    tensors; 16-bit parameters of the frozen ones."""
    return shape.trainable_params * (half + half + 4 + 8 + z_bytes + u_bytes) + sum(shape.frozen) * half


def check_nvme_param_buffers(model: torch.nn.Module, ds: dict, world: int = 1) -> None:
    """DeepSpeed's NVMe parameter swapper keeps a parameter's partition (ceil(numel / world) entries) in one of its
    buffers, so buffer_size must hold the largest one (``get_buffer`` asserts otherwise); say so before loading.

    ``model`` may be a meta-device instance (only shapes are read).
    """
    section = ds.get("zero_optimization", {}).get("offload_param", {})
    if section.get("device") != "nvme":
        return
    largest = max(p.numel() for p in model.parameters())
    partition = -(-largest // world)
    size = param_buffer_size(ds["zero_optimization"], largest, world)
    if size < partition:
        raise ElsaError(
            f"zero_optimization.offload_param.buffer_size is {size:.3g} elements but the model's largest parameter has "
            f"{largest:,} (usually the embedding), {partition:,} per rank on {world}; set buffer_size to at least {partition}"
        )
