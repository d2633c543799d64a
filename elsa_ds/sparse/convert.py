"""A loaded, pruned model in sparse mode without a checkpoint on disk: ``sparsify(model)``.

``from_pretrained(path, mode="sparse")`` builds its SparseLinears from a checkpoint's stored codes; ``sparsify`` builds
the same modules from a model already in memory (a pruned model just loaded, or one a one-shot method pruned in
place), encoding each pruned Linear weight on the device it is on. The result is a second model object: the one given
is left as it was, and the two share every tensor that is not a pruned Linear weight (embeddings, norms, the head,
the biases), so the sparse twin costs only its codes, and the dense model stays usable beside it (to compare, or to
be dropped).
"""
from __future__ import annotations

import copy
import numbers
from typing import TYPE_CHECKING, Any

import torch

from elsa_ds.sparse import format as fmt
from elsa_ds.sparse.compress import DEFAULT_MIN_SPARSITY
from elsa_ds.sparse.integrity import SparseArgumentError, check_type
from elsa_ds.sparse.linear import SparseLinear, check_decode_path, default_path
from elsa_ds.sparse.saving import saves_dense
from elsa_ds.sparse.siblings import SiblingSlice, ready_to_decode

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def sparsify(model: PreTrainedModel, min_sparsity: float = DEFAULT_MIN_SPARSITY, decode_path: str | None = None) -> PreTrainedModel:
    """A sparse-mode twin of ``model`` (a transformers model whose pruned weights hold their zeros), in eval mode.

    Every nn.Linear whose weight has at least ``min_sparsity`` zeros (as ``compress`` decides) becomes a SparseLinear,
    encoded on the weight's device; a weight tied to another module (an LM head tied to the embeddings) stays dense, as
    ``from_pretrained`` loads it. ``decode_path`` as in ``from_pretrained``. On CUDA, generate() takes a static cache
    (its decode step compiled into a CUDA graph), as ``from_pretrained(..., mode="sparse")`` sets it. The twin shares
    ``model``'s parameters as they are (trainable, unlike the loader's frozen ones), so its forward outside
    ``torch.no_grad()`` takes the dense path, which carries gradients; ``generate()`` runs without them. Its
    ``save_pretrained`` writes the dense model. SparseArgumentError when no Linear is that sparse (is this the pruned
    model?) or the model spans several devices.
    """
    device = _check_arguments(model, min_sparsity, decode_path)
    twin = _shell(model)
    shared = _tied(model)
    converted = 0
    for name, module in list(twin.named_modules()):
        if not isinstance(module, torch.nn.Linear) or id(module.weight) in shared:
            continue
        weight = module.weight.detach()
        if not fmt.compressible(weight, min_sparsity):
            continue
        rows, cols = weight.shape
        sparse = SparseLinear(fmt.encode_delta8(weight), (rows, cols), module.bias,
                              decode_path=default_path(weight.dtype, decode_path), name=f"{name}.weight")
        parent, _, child = name.rpartition(".")
        setattr(twin.get_submodule(parent) if parent else twin, child, sparse)
        converted += 1
    if not converted:
        raise SparseArgumentError(f"no nn.Linear weight of this {type(model).__name__} has {min_sparsity:.0%} or more zeros, so "
                                  "nothing would get smaller; is this the pruned model? (lower min_sparsity to convert less "
                                  "sparse weights)")
    saves_dense(twin)
    ready_to_decode(twin, device)
    return twin.eval()


def _check_arguments(model: Any, min_sparsity: float, decode_path: str | None) -> torch.device:
    """Each argument of the right type and value, or one line saying which is not; the model's one device."""
    check_type("model", model, torch.nn.Module, "a transformers model (a PreTrainedModel)")
    if not hasattr(model, "config") or not hasattr(model, "generation_config"):
        raise SparseArgumentError(f"model: a {type(model).__name__} has no config / generation_config; sparsify takes a "
                                  "transformers model (AutoModelForCausalLM.from_pretrained's)")
    check_type("min_sparsity", min_sparsity, numbers.Real, "a fraction in (0, 1]")
    if not 0.0 < min_sparsity <= 1.0:
        raise SparseArgumentError(f"min_sparsity {min_sparsity}: expected a fraction in (0, 1]")
    check_decode_path(decode_path)
    if any(isinstance(m, (SparseLinear, SiblingSlice)) for m in model.modules()):
        raise SparseArgumentError(f"this {type(model).__name__} is in sparse mode already (from_pretrained's mode='sparse' or "
                                  "sparsify's): use it as it is")
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1:
        raise SparseArgumentError(f"the model's tensors are on {len(devices)} devices ({', '.join(sorted(map(str, devices)))}); "
                                  "sparsify takes a model on one device: move it there first (model.to(device))")
    (device,) = devices
    if device.type == "meta":
        raise SparseArgumentError("the model is on the meta device (no weights): load or move its weights first")
    return device


def _tied(model: torch.nn.Module) -> set[int]:
    """ids of the parameters more than one module holds (tied weights)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def _shell(model: PreTrainedModel) -> PreTrainedModel:
    """A new model object of ``model``'s class and config (built on the meta device: no memory, no initialisation),
    holding ``model``'s own parameters and buffers (the same tensor objects, tied ones tied the same way)."""
    from transformers.initialization import no_init_weights

    config = copy.deepcopy(model.config)  # the twin's __init__ may write to its config (the attention implementation)
    with torch.device("meta"), no_init_weights():
        twin = type(model)(config)
    twin.generation_config = copy.deepcopy(model.generation_config)
    for name, param in model.named_parameters(remove_duplicate=False):
        _put(twin, name, param, "_parameters")
    for name, buf in model.named_buffers(remove_duplicate=False):
        _put(twin, name, buf, "_buffers")
    left = [n for n, t in (*twin.named_parameters(), *twin.named_buffers()) if t.is_meta]
    left += [f"{n}.{k}" for n, m in twin.named_modules() for k, v in vars(m).items() if torch.is_tensor(v) and v.is_meta]
    if left:
        raise SparseArgumentError(f"{type(model).__name__}: {left[0]} has no counterpart in the model given (built from its "
                                  "config, the twin has tensors the model does not); sparsify cannot share it")
    return twin


def _put(twin: torch.nn.Module, name: str, tensor: torch.Tensor, where: str) -> None:
    module_name, _, leaf = name.rpartition(".")
    try:
        module = twin.get_submodule(module_name) if module_name else twin
    except AttributeError:
        raise SparseArgumentError(f"the model holds {name}, which a {type(twin).__name__} built from its config does not: "
                                  "sparsify takes a model whose modules its config describes") from None
    getattr(module, where)[leaf] = tensor
