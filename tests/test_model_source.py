"""A model given in memory (the Python API's ``elsa_ds.prune(model, ...)``) is cast to the run's dtype as DeepSpeed casts
a module and as ``from_pretrained(dtype=...)`` leaves one: its parameters, not its buffers, so it computes what the same
model named by its folder computes."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from elsa_ds.models import ModelSource, load_causal_lm


def test_a_model_given_in_memory_computes_what_the_same_model_loaded_by_name_computes(tiny_model_dir):
    given = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)  # as a user loads it
    tied = given.get_output_embeddings().weight is given.get_input_embeddings().weight
    cast = ModelSource(str(tiny_model_dir), given).load(torch.bfloat16)
    named = load_causal_lm(str(tiny_model_dir), torch.bfloat16)
    assert cast is given and all(p.dtype is torch.bfloat16 for p in cast.parameters())
    assert (cast.get_output_embeddings().weight is cast.get_input_embeddings().weight) == tied
    buffers = dict(named.named_buffers())
    assert buffers["model.rotary_emb.inv_freq"].dtype is torch.float32  # what the cast must leave (bf16 when cast whole)
    assert {n: b.dtype for n, b in cast.named_buffers() if n.endswith("inv_freq")} == {
        n: b.dtype for n, b in buffers.items() if n.endswith("inv_freq")}
    ids = torch.arange(3, 3 + 2 * 60).reshape(2, 60) % 500
    with torch.no_grad():
        assert torch.equal(cast(input_ids=ids).logits, named(input_ids=ids).logits)
