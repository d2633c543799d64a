"""Loading causal LMs: one attention rule, cheap checks before any weight is read, meta-device instances.

Every path that builds a model goes through here: the ZeRO-3 job (``zero/engine.py``, into partitions), the
one-shot methods (whole model in host memory), evaluation (one device or ``device_map="auto"``) and the
memory estimator (meta device: shapes without memory).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elsa_ds.data import load_tokenizer
from elsa_ds.data.blocks import check_local_tokenizer
from elsa_ds.errors import ElsaError

_HEADER_LIMIT = 100 * 2**20  # safetensors headers are small; a larger "length" means a corrupt file


def load_config(model_id: str):
    """The model's transformers config, or an ElsaError that says whether a directory or a hub id failed."""
    from transformers import AutoConfig

    path = Path(model_id).expanduser()
    if model_id.startswith((".", "/", "~")) and not path.exists():
        raise ElsaError(f"model {model_id}: no such directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ElsaError(f"model {model_id}: directory has no config.json (not a saved transformers model)")
    try:
        config = AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError) as err:
        raise ElsaError(f"model {model_id}: cannot load its config ({str(err).splitlines()[0]})") from None
    check_causal_lm(config, model_id)
    return config


# heads that predict the next token: what ELSA's loss, the one-shot calibration and perplexity all need
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def check_causal_lm(config, model_id: str) -> None:
    """ElsaError for a model that is not a causal LM (an encoder such as BERT saved as a masked LM, a classifier, a
    sequence-to-sequence model): transformers would load some of them into a causal-LM class with a warning and the job
    would train or score next-token prediction the model was never built for."""
    archs = list(getattr(config, "architectures", None) or [])
    kind = f"{getattr(config, 'model_type', '?')} ({', '.join(archs) or 'no architectures listed'})"
    if getattr(config, "is_encoder_decoder", False):
        raise ElsaError(f"model {model_id} is an encoder-decoder model, {kind}: elsa_ds prunes decoder-only causal LMs")
    if archs and not any(a.endswith(CAUSAL_HEADS) for a in archs):
        raise ElsaError(f"model {model_id} is {kind}, not a causal language model (a ...ForCausalLM): ELSA prunes on the "
                        "next-token loss, which this model was not trained for")


def attention_implementation(config) -> str:
    """eager for Gemma-2 (sdpa drops its attention-logit soft-capping, and flash-attn's softcap has no backward);
    sdpa otherwise."""
    return "eager" if getattr(config, "model_type", "") == "gemma2" else "sdpa"


def hidden_size(config) -> int | None:
    return getattr(getattr(config, "text_config", config), "hidden_size", None)


def check_local_weights(model_id: str) -> None:
    """Each safetensors file of a local model directory has a readable header and the size its header announces.

    A truncated download or copy otherwise fails deep inside from_pretrained, after minutes of loading.
    """
    path = Path(model_id).expanduser()
    if not path.is_dir():
        return
    for file in sorted(path.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem:
            raise ElsaError(f"model {model_id}: {file.name} is damaged ({problem}); copy or download it again")


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    with file.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{size} bytes, no header"
        (length,) = struct.unpack("<Q", head)
        if length > min(_HEADER_LIMIT, size - 8):
            return "header length beyond the end of the file"
        try:
            header = json.loads(fh.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "header is not valid JSON"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    return None if expected == size else f"{size:,} bytes, its header needs {expected:,}"


def load_causal_lm(model_id: str, dtype: torch.dtype, *, random_init: bool = False, config=None, **kwargs: Any) -> torch.nn.Module:
    """``from_pretrained`` (or ``from_config`` with ``random_init``) with the attention rule; ElsaError on failure.

    Under a live ``HfDeepSpeedConfig`` with ZeRO-3 both build straight into partitions.
    """
    from transformers import AutoModelForCausalLM

    config = config or load_config(model_id)
    attn = attention_implementation(config)
    try:
        if random_init:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, attn_implementation=attn, **kwargs)
    except (OSError, ValueError) as err:
        raise ElsaError(f"cannot load model {model_id!r}: {str(err).splitlines()[0]}") from None
    model.config.use_cache = False  # scoring and training forwards build no KV cache
    return model


def embedding_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The input embedding's and the output head's weights (one tensor when tied)."""
    modules = (model.get_input_embeddings(), model.get_output_embeddings())
    return list({id(m.weight): m.weight for m in modules if m is not None}.values())


def freeze_embeddings(model: torch.nn.Module) -> None:
    """Take the input embedding and the output head out of training (--freeze_embeddings)."""
    for weight in embedding_weights(model):
        weight.requires_grad_(False)


def meta_model(config) -> torch.nn.Module:
    """An instance of the architecture on the meta device: exact shapes and names, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@dataclass
class ModelSource:
    """A model named by hub id or directory, or one already in memory (``module``, with its ``tokenizer``).

    An in-memory model is used as it is, not copied: a ZeRO-3 job partitions its parameters (the object is
    consumed; load the result from the output directory), a one-shot job prunes it in place.
    """

    name: str
    module: torch.nn.Module | None = None
    tokenizer: Any = None

    def config(self):
        return self.module.config if self.module is not None else load_config(self.name)

    def check_weights(self) -> None:
        if self.module is None:
            check_local_weights(self.name)

    def check_tokenizer(self) -> None:
        if self.tokenizer is None:
            check_local_tokenizer(self.name)

    def load_tokenizer(self):
        return self.tokenizer if self.tokenizer is not None else load_tokenizer(self.name)

    def load(self, dtype: torch.dtype, random_init: bool = False) -> torch.nn.Module:
        """The model in ``dtype``: the in-memory one, or loaded (``random_init``: built from the config)."""
        if self.module is None:
            return load_causal_lm(self.name, dtype, random_init=random_init)
        if random_init:
            raise ElsaError("random_init builds a model from its config; it cannot be combined with a model given in memory")
        self.module.config.use_cache = False
        return self.module.to(dtype)
