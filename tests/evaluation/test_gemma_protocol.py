"""The Gemma perplexity protocols against the ELSA authors' own ``calculate_ppl``, transcribed from hyeondo-jang/prune_lora
``lib/eval.py`` (their code below; only the ``testenc`` argument and ``model.seqlen`` are set up here as their
``eval_ppl`` does: ``tokenizer("\\n\\n".join(texts), return_tensors="pt")``, batch size 1, "Gemma" in the architecture).

History of that function: commit 2947127 (2025-09-12) prepended BOS to the seqlen-1 tokens starting at i*seqlen;
commit 9494189 ("FIX gemma evaluation", 2025-09-14) replaced that by overwriting the first token of each full window
with BOS, and that is the function at the repository's head (ae217f7, 2025-11-18; the older one kept there commented
out). ``--ppl_protocol window`` (``auto`` for Gemma) is the head's, ``--ppl_protocol prepend`` the 2947127 one.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

from tests.architectures.models import make_arch_model
from tests.conftest import _save_tokenizer, run_entry

SEQLEN = 128


@torch.no_grad()
def calculate_ppl_head(model, testenc, tokenizer, bs: int = 1) -> float:
    """prune_lora lib/eval.py ``calculate_ppl`` at 9494189 .. ae217f7 (head), verbatim but for comments."""
    seqlen = model.seqlen
    testenc = testenc.input_ids
    nsamples = testenc.numel() // seqlen
    nlls = []
    for i in range(0, nsamples, bs):
        j = min(i + bs, nsamples)
        batch_size = j - i
        model_inputs = testenc[:, (i * seqlen):(j * seqlen)].to(model.device)
        model_inputs = model_inputs.reshape(batch_size, seqlen)
        is_gemma = 'Gemma' in model.config.architectures[0]
        if is_gemma:
            model_inputs[:, 0] = tokenizer.bos_token_id
        shift_labels = model_inputs[:, 1:].contiguous()
        with torch.no_grad():
            lm_logits = model(model_inputs).logits
        shift_logits = lm_logits[:, :-1, :].contiguous()
        loss_fct = nn.CrossEntropyLoss()
        loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1)).to(torch.float32), shift_labels.view(-1))
        neg_log_likelihood = loss.float() * (shift_labels.numel() / batch_size)
        nlls.append(neg_log_likelihood)
    ppl = torch.exp(torch.stack(nlls).sum() / (nsamples * seqlen))
    return ppl.item()


@torch.no_grad()
def calculate_ppl_2947127(model, testenc, tokenizer, bs: int = 1) -> float:
    """prune_lora lib/eval.py ``calculate_ppl`` at 2947127, verbatim but for comments (it reads ``model.seq_len``)."""
    seqlen = model.seq_len
    testenc = testenc.input_ids
    nsamples = testenc.numel() // seqlen
    nlls = []
    for i in range(0, nsamples, bs):
        j = min(i + bs, nsamples)
        batch_size = j - i
        is_gemma = 'Gemma' in model.config.architectures[0]
        if is_gemma:
            inputs_slice = testenc[:, (i * seqlen):(i * seqlen + (batch_size * (seqlen - 1)))].to(model.device)
            inputs_slice = inputs_slice.reshape(batch_size, seqlen - 1)
            bos_tensor = torch.tensor([[tokenizer.bos_token_id] * batch_size]).reshape(batch_size, 1).to(model.device)
            model_inputs = torch.cat([bos_tensor, inputs_slice], dim=1)
            shift_labels = inputs_slice.contiguous()
        else:
            model_inputs = testenc[:, (i * seqlen):(j * seqlen)].to(model.device)
            model_inputs = model_inputs.reshape(batch_size, seqlen)
            shift_labels = model_inputs[:, 1:].contiguous()
        with torch.no_grad():
            lm_logits = model(model_inputs).logits
        shift_logits = lm_logits[:, :-1, :].contiguous()
        loss_fct = nn.CrossEntropyLoss()
        loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1)).to(torch.float32), shift_labels.view(-1))
        neg_log_likelihood = loss.float() * (shift_labels.numel() / batch_size)
        nlls.append(neg_log_likelihood)
    ppl = torch.exp(torch.stack(nlls).sum() / (nsamples * seqlen))
    return ppl.item()


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, tiny_model_dir):
    """A tiny random Gemma-3 (sliding and full attention, 1 KV head) whose tokenizer prepends BOS, as Gemma's does."""
    d = make_arch_model(tmp_path_factory.mktemp("gemma3_bos"), "gemma3_text", tiny_model_dir)
    _save_tokenizer(d, bos_first=True)
    return d


@pytest.mark.integration
@pytest.mark.parametrize("protocol, reference", [("window", calculate_ppl_head), ("prepend", calculate_ppl_2947127)])
def test_evaluate_matches_the_authors_calculate_ppl(protocol, reference, gemma3_dir, text_dir, tmp_path, offline):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text_file = tmp_path / "macbeth.txt"
    text = (text_dir / "macbeth.txt").read_text(encoding="utf-8")[:30000]
    text_file.write_text(text, encoding="utf-8")
    out = tmp_path / "result.json"
    requested = "auto" if protocol == "window" else protocol
    run_entry("evaluate.py", ["--model", str(gemma3_dir), "--ppl", str(text_file), "--seqlen", str(SEQLEN), "--ppl_protocol",
                              requested, "--batch_size", "3", "--output", str(out)], timeout=300)
    result = json.loads(out.read_text())

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model.seqlen = model.seq_len = SEQLEN
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    testenc = tokenizer("\n\n".join([text]), return_tensors="pt")
    assert testenc.input_ids[0, 0] == tokenizer.bos_token_id and "Gemma" in model.config.architectures[0]
    expected = reference(model, testenc, tokenizer, 1)

    got = result["ppl"][str(text_file)]
    n = testenc.input_ids.numel() // SEQLEN
    assert got["windows"] == n > 10 and got["tokens"] == n * (SEQLEN - 1)
    assert abs(got["ppl"] / expected - 1) < 1e-4, (got["ppl"], expected)
    assert result["protocol"]["ppl"] == protocol and result["protocol"]["ppl_requested"] == requested
    # beside it, the mean per predicted token: their figure is exp of (L-1)/L of it
    assert got["ppl_per_token"] == pytest.approx(math.exp(got["nll_sum"] / got["tokens"]), rel=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(got["nll_sum"] / got["denominator"]), rel=1e-12)  # the sum's divisor, said
    assert math.log(got["ppl"]) == pytest.approx(math.log(got["ppl_per_token"]) * (SEQLEN - 1) / SEQLEN, rel=1e-9)


def test_the_two_versions_differ_on_this_text(gemma3_dir, text_dir):
    """The protocols are different numbers (so the test above tells them apart), and prepend never reads a window's last
    token while window never reads its first."""
    from transformers import AutoTokenizer

    from elsa_ds.data import Documents, PplProtocol, ppl_windows

    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    docs = Documents([(text_dir / "macbeth.txt").read_text(encoding="utf-8")[:5000]], "t")
    ids = tokenizer("\n\n".join(docs.joined()), return_tensors="pt").input_ids[0]
    window = ppl_windows(docs, "t", tokenizer, 32, PplProtocol.window).ids
    prepend = ppl_windows(docs, "t", tokenizer, 32, PplProtocol.prepend).ids
    assert window.shape == prepend.shape and (window[:, 0] == prepend[:, 0]).all() and (window[:, 0] == tokenizer.bos_token_id).all()
    for i in range(window.shape[0]):
        assert torch.equal(window[i, 1:], ids[i * 32 + 1:(i + 1) * 32])
        assert torch.equal(prepend[i, 1:], ids[i * 32:(i + 1) * 32 - 1])
