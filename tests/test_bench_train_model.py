"""bench/models/train_model.py end to end on a tiny corpus: training with the in-loop validation probe, the saved
model and tokenizer, and the held-out perplexities through the evaluation code (the path build.py runs for an hour)."""
from __future__ import annotations

import json
import math

import pytest

from bench.models.train_model import TrainSettings, train

WORDS = ("the kernel maps a page into the process address space and the driver reads the buffer "
         "when an interrupt arrives the handler wakes the waiting task and returns").split()


def _corpus(folder):
    folder.mkdir()
    for split, docs in (("train", 40), ("validation", 6), ("test", 6)):
        with (folder / f"{split}.jsonl").open("w") as fh:
            for d in range(docs):
                text = " ".join(WORDS[(d * 7 + i * 3) % len(WORDS)] for i in range(60))
                fh.write(json.dumps({"text": text}) + "\n")
    return folder


@pytest.mark.parametrize("arch,add_bos", [("llama", True), ("qwen2", False)])
def test_train_runs_the_probe_saves_and_scores_held_out_text(tmp_path, arch, add_bos):
    corpus = _corpus(tmp_path / "corpus")
    s = TrainSettings(arch=arch, arch_kwargs={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                              "num_attention_heads": 2, "num_key_value_heads": 1},
                      vocab=300, add_bos=add_bos, seqlen=32, batch=2, steps=3, eval_every=2, eval_blocks=2, threads=1)
    out = tmp_path / "model"
    metrics = train(s, corpus, out)
    assert [c["step"] for c in metrics["val_curve"]] == [2, 3]  # the probe ran mid-training and at the end
    assert all(math.isfinite(c["val_probe_ppl"]) and c["val_probe_ppl"] > 1 for c in metrics["val_curve"])
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert metrics["arch"] == arch and math.isfinite(metrics["val_ppl"]) and math.isfinite(metrics["test_ppl"])
