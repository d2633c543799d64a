"""The consolidated export: a Hugging Face model directory written by rank 0 from the ZeRO-3 partitions."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from elsa_ds.zero import compat
from elsa_ds.zero.engine import ZeroJob


def export_model(job: ZeroJob, tokenizer, out_dir: Path,
                 transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> None:
    """Write sharded safetensors, config, generation config and tokenizer to ``out_dir`` (rank 0). Collective.

    ``transform`` maps rank 0's consolidated state dict before it is saved (LoRA: adapters merged, mask re-applied).
    """
    from huggingface_hub import save_torch_state_dict

    state_dict = compat.gather_16bit_state_dict(job.engine)
    if job.comm.rank != 0:
        return
    if transform is not None:
        state_dict = transform(state_dict)
    model = job.engine.module
    tied = [k for k in ("lm_head.weight",) if getattr(model.config, "tie_word_embeddings", False) and k in state_dict]
    for k in tied:  # the tie is restored by from_pretrained from the config
        del state_dict[k]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(state_dict, out_dir, max_shard_size="5GB")
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
