"""The consolidated export: a Hugging Face model directory written by rank 0 from the ZeRO-3 partitions.

Streamed: the tensors' names, full shapes and dtypes fix the shards and their headers before any data moves;
then every rank gathers one parameter at a time (a collective) and rank 0 appends it to its shard and lets it
go. Host memory on rank 0 never holds more than the largest parameter (on a GPU node: the gathered copy on
each GPU plus one host copy on rank 0) -- not the whole 16-bit model that DeepSpeed's consolidated state dict
would put there (54 GB for Gemma-2-27B).

A tied ``lm_head.weight`` is left out (``from_pretrained`` restores the tie from the config), as
``save_pretrained`` does.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from elsa_ds.files.safetensors_writer import DEFAULT_MAX_SHARD_SIZE, ShardedWriter, TensorSpec
from elsa_ds.zero import compat
from elsa_ds.zero.dist import agreed

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def export_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter or buffer) in state-dict order: parameters once (a tied second name is dropped), persistent
    buffers. Every rank returns the same list."""
    seen: set[int] = set()
    out = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out.append((name, tensor))
    return out


def export_model(module: PreTrainedModel, tokenizer, out_dir: Path, rank: int, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> int:
    """Write sharded safetensors, config, generation config and tokenizer to ``out_dir`` (rank 0). Collective: every rank
    must call it, since each parameter is gathered from all ranks in turn. A write that fails on rank 0 (a full disk)
    stops its writing, not its gathers: the ranks agree at the end, and every one raises. Returns the largest tensor's
    bytes."""
    import deepspeed

    tensors = export_tensors(module)
    specs = [TensorSpec(name, compat.full_shape(t), t.dtype) for name, t in tensors]
    failed: list[Exception] = []  # rank 0's first failed write: the others are still gathering
    with agreed(f"export to {out_dir}"):
        with contextlib.ExitStack() as stack:
            opened: list[ShardedWriter] = []  # rank 0's writer, made (its folder too) at its first write

            def writer() -> ShardedWriter:
                if not opened:
                    opened.append(stack.enter_context(ShardedWriter(out_dir, specs, max_shard_size)))
                return opened[0]

            def on_rank_0(action: Callable[[], object]) -> None:
                if rank == 0 and not failed:
                    try:
                        action()
                    except Exception as err:  # noqa: BLE001 - raised once the gathers are done
                        failed.append(err)

            for name, tensor in tensors:
                if not isinstance(tensor, torch.nn.Parameter):  # a buffer: whole on every rank
                    on_rank_0(lambda: writer().write(name, tensor))
                    continue
                with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):  # collective: one parameter at a time
                    on_rank_0(lambda: writer().write(name, tensor.data))
            on_rank_0(writer)  # a model of no tensors still gets its (empty) index
            if failed:
                raise failed[0]  # the writer leaves its shards unfinished
        if rank == 0:
            _side_files(module, tokenizer, out_dir)
    return max((s.nbytes for s in specs), default=0) if rank == 0 else 0


def _side_files(module: PreTrainedModel, tokenizer, out_dir: Path) -> None:
    """The config, generation config and tokenizer beside the exported weights."""
    module.config.save_pretrained(out_dir)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def export_consolidated(job, tokenizer, out_dir: Path,
                        transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> None:
    """``export_model`` through DeepSpeed's consolidated state dict, for an export that must see the whole model at once.
    Collective. Rank 0 holds the whole 16-bit model in host memory: used for LoRA baselines only, never for ELSA.

    ``transform`` maps rank 0's consolidated state dict before it is saved (LoRA: the adapters, already merged in place,
    dropped and the base weights renamed: ``finetune.lora.plain_state_dict``).
    """
    from huggingface_hub import save_torch_state_dict

    state_dict = compat.gather_16bit_state_dict(job.engine)
    if job.comm.rank != 0:
        return
    assert state_dict is not None, "rank 0 gets the consolidated state dict"
    if transform is not None:
        state_dict = transform(state_dict)
    model = job.engine.module
    tied = [k for k in ("lm_head.weight",) if getattr(model.config, "tie_word_embeddings", False) and k in state_dict]
    for k in tied:  # the tie is restored by from_pretrained from the config
        del state_dict[k]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state_dict, out_dir, max_shard_size="5GB")
    _side_files(model, tokenizer, out_dir)
