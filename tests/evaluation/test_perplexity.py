"""Perplexity through launch/evaluate.py equals the published protocols, transcribed here from the reference code."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from tests.conftest import run_entry

SEQLEN = 128


def _load(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def wanda_eval_ppl(model, tokenizer, text: str, seqlen: int) -> tuple[float, int]:
    """Wanda's lib/data.py (``testenc = tokenizer(text, return_tensors='pt')``) and lib/eval.py ``eval_ppl_wikitext``."""
    testenc = tokenizer(text, return_tensors="pt").input_ids
    nsamples = testenc.numel() // seqlen
    nlls = []
    for i in range(nsamples):
        inputs = testenc[:, (i * seqlen):((i + 1) * seqlen)].reshape(1, seqlen)
        lm_logits = model(inputs).logits
        shift_logits = lm_logits[:, :-1, :].contiguous()
        shift_labels = inputs[:, 1:]
        loss = nn.CrossEntropyLoss()(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1))
        nlls.append(loss.float() * seqlen * 1)
    return torch.exp(torch.stack(nlls).sum() / (nsamples * seqlen)).item(), nsamples


@torch.no_grad()
def elsa_calculate_ppl(model, tokenizer, text: str, seqlen: int) -> tuple[float, int]:
    """The ELSA authors' lib/eval.py ``calculate_ppl`` (bs 1) on ``tokenizer(text, return_tensors='pt')``, Gemma branch, as
    of their commit 9494189 and their head ae217f7 (the older 2947127 version: tests/evaluation/test_gemma_protocol.py)."""
    testenc = tokenizer(text, return_tensors="pt").input_ids
    nsamples = testenc.numel() // seqlen
    nlls = []
    for i in range(nsamples):
        model_inputs = testenc[:, (i * seqlen):((i + 1) * seqlen)].clone().reshape(1, seqlen)
        assert "Gemma" in model.config.architectures[0]
        model_inputs[:, 0] = tokenizer.bos_token_id
        shift_labels = model_inputs[:, 1:].contiguous()
        shift_logits = model(model_inputs).logits[:, :-1, :].contiguous()
        loss = nn.CrossEntropyLoss()(shift_logits.view(-1, shift_logits.size(-1)).to(torch.float32), shift_labels.view(-1))
        nlls.append(loss.float() * (shift_labels.numel() / 1))
    return torch.exp(torch.stack(nlls).sum() / (nsamples * seqlen)).item(), nsamples


def _evaluate(tmp_path, model_dir, text_file, protocol: str) -> dict:
    out = tmp_path / "result.json"
    run_entry("evaluate.py", ["--model", str(model_dir), "--ppl", str(text_file), "--seqlen", str(SEQLEN), "--ppl_protocol", protocol,
                              "--batch_size", "4", "--output", str(out)], timeout=300)
    return json.loads(out.read_text())


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_evaluate_equals_the_published_protocol(tmp_path, llama_model_dir, gemma_bos_model_dir, text_dir, offline, family):
    """stream == Wanda's eval_ppl on a Llama whose tokenizer prepends BOS; window == the ELSA authors' Gemma calculate_ppl."""
    model_dir, protocol, reference = ((llama_model_dir, "stream", wanda_eval_ppl) if family == "llama"
                                      else (gemma_bos_model_dir, "window", elsa_calculate_ppl))
    text_file = tmp_path / "macbeth.txt"
    text_file.write_text((text_dir / "macbeth.txt").read_text(encoding="utf-8")[:30000], encoding="utf-8")
    result = _evaluate(tmp_path, model_dir, text_file, protocol)
    expected, n_windows = reference(*_load(model_dir), text_file.read_text(encoding="utf-8"), SEQLEN)
    got = result["ppl"][str(text_file)]
    assert got["windows"] == n_windows > 10 and got["tokens"] == n_windows * (SEQLEN - 1)
    assert abs(got["ppl"] / expected - 1) < 1e-4, (got["ppl"], expected)
    assert result["protocol"]["ppl"] == result["protocol"]["ppl_requested"] == protocol
    assert result["protocol"]["ppl_layout"].startswith("the joined text" if protocol == "stream" else "the same consecutive windows")


@pytest.mark.integration
def test_local_text_ppl_and_sparsity(tmp_path, sixty_model_dir, text_dir, offline):
    text_file = tmp_path / "macbeth.txt"
    text_file.write_text((text_dir / "macbeth.txt").read_text(encoding="utf-8")[:40000], encoding="utf-8")
    out, md = tmp_path / "result.json", tmp_path / "result.md"
    proc = run_entry("evaluate.py", ["--model", str(sixty_model_dir), "--ppl", str(text_file), "--seqlen", str(SEQLEN),
                                     "--batch_size", "4", "--output", str(out), "--markdown", str(md)], timeout=300)
    result = json.loads(out.read_text())

    expected, n_windows = elsa_calculate_ppl(*_load(sixty_model_dir), text_file.read_text(encoding="utf-8"), SEQLEN)
    got = result["ppl"][str(text_file)]
    assert got["windows"] == n_windows > 10 and got["text"]["documents"] == 1
    assert abs(got["ppl"] / expected - 1) < 1e-4, (got["ppl"], expected)

    assert result["seqlen"] == SEQLEN and result["protocol"]["ppl"] == "window" and result["protocol"]["ppl_requested"] == "auto"
    assert result["dtype"] == "float32" and result["model_type"] == "gemma2"
    assert result["sparsity"]["pattern"] == "unstructured"
    assert abs(result["sparsity"]["overall"] - 0.6) < 1e-4
    assert {"elsa_ds", "torch", "transformers", "lm_eval"} <= set(result["versions"])
    assert result["tasks"] == {} and result["average_acc"] is None
    assert f"{got['ppl']:.3f}" in md.read_text() and f"{got['ppl']:.3f}" in proc.stdout and "Perplexity protocol: window" in md.read_text()
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries
