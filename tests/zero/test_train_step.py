"""zero/steps.train_step, the step every training job shares: what it keeps alive through the backward."""
from __future__ import annotations

import types
import weakref

import torch
from transformers import AutoModelForCausalLM

from elsa_ds.settings.config import DEMO_MODEL_DIR
from elsa_ds.zero import steps


def test_a_training_step_lets_the_logits_go_before_the_backward():
    """zero/steps.train_step: once the loss holds the logits' gradient, nothing holds the [tokens, vocab] logits through
    the backward (at Gemma's 262,144-entry vocabulary, 32 x 512 tokens, they are 8 GiB of a GPU cell's peak)."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    seen: dict = {}

    class Engine:  # the engine's surface train_step uses; the model and the autograd are real
        device, optimizer, module = torch.device("cpu"), types.SimpleNamespace(), model

        def __call__(self, **kwargs):
            out = model(**kwargs)
            seen["logits"] = weakref.ref(out.logits)
            return out

        def backward(self, loss):
            seen["alive_in_backward"] = seen["logits"]() is not None
            loss.backward()

        def step(self):
            pass

    comm = types.SimpleNamespace(all_reduce_sum=lambda t: None)
    loss = steps.train_step(Engine(), torch.optim.SGD(model.parameters(), lr=0.0), comm, [torch.randint(0, 100, (2, 16))], 0.0)
    assert loss > 0 and seen["alive_in_backward"] is False
