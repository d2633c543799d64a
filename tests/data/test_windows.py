"""Perplexity windows: the token layouts of the stream (SparseGPT/Wanda) and window (ELSA authors, Gemma) protocols."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from elsa_ds.data import Documents, PplProtocol, is_gemma, ppl_windows, resolve_protocol
from elsa_ds.errors import ElsaError
from tests.conftest import play_text


def test_layouts(llama_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_model_dir)
    docs = Documents([play_text("macbeth")[:6000], play_text("othello")[:6000]], "two documents")
    ids = tok(docs.texts[0] + "\n\n" + docs.texts[1], return_tensors="pt").input_ids[0]
    stream = ppl_windows(docs, "x", tok, 50, PplProtocol.stream)
    n = ids.numel() // 50
    assert stream.count == n and stream.text_tokens == ids.numel() and stream.documents == 2
    assert torch.equal(stream.ids, ids[:n * 50].view(n, 50))           # consecutive slices of one tokenization
    assert stream.ids[0, 0] == tok.bos_token_id and (stream.ids[1:, 0] != tok.bos_token_id).all()  # BOS once, first
    window = ppl_windows(docs, "x", tok, 50, PplProtocol.window, PplProtocol.auto, max_windows=7)
    assert window.count == 7 and (window.ids[:, 0] == tok.bos_token_id).all()
    assert torch.equal(window.ids[:, 1:], stream.ids[:7, 1:])          # BOS overwrites the first token, nothing shifts
    assert window.describe()["protocol"] == {"name": "window", "requested": "auto", "layout": window.describe()["protocol"]["layout"]}
    assert stream.perplexity(2.0 * 10 * 49, 10 * 49) == pytest.approx(math.exp(2.0))                 # 10 windows, 2 nats a token
    assert window.perplexity(2.0 * 10 * 49, 10 * 49) == pytest.approx(math.exp(2.0 * 49 / 50))     # their nsamples * seqlen
    c4 = ppl_windows(Documents([play_text("othello")], "one text"), "c4", tok, 16, PplProtocol.stream)
    assert c4.count == 256                                             # C4: truncated to 256 x seqlen tokens


def test_auto_protocol_per_family():
    gemma = SimpleNamespace(model_type="gemma2", architectures=["Gemma2ForCausalLM"])
    llama = SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"])
    assert is_gemma(gemma) and not is_gemma(llama) and is_gemma(SimpleNamespace(model_type="x", architectures=["GemmaForCausalLM"]))
    assert resolve_protocol("auto", gemma) is PplProtocol.window and resolve_protocol("auto", llama) is PplProtocol.stream
    assert resolve_protocol("stream", gemma) is PplProtocol.stream


def test_window_protocol_needs_bos(llama_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_model_dir)
    tok.bos_token = None
    with pytest.raises(ElsaError, match="no BOS"):
        ppl_windows(Documents(["some text " * 50], "t"), "x", tok, 16, PplProtocol.window)
