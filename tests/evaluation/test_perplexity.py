"""Perplexity through launch/evaluate.py equals the protocol computed by hand on the same text."""
from __future__ import annotations

import json
import math

import pytest
import torch

from elsa_ds.evaluation.run import max_windows
from tests.conftest import run_entry

SEQLEN = 128


def independent_ppl(model_dir, text: str, seqlen: int) -> tuple[float, int]:
    """[BOS] + (seqlen - 1) tokens per window, the text followed by EOS, remainder dropped; exp(mean NLL)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    stream = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    body = seqlen - 1
    windows = torch.tensor([[tok.bos_token_id] + stream[i:i + body] for i in range(0, len(stream) - body + 1, body)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=windows).logits.float(), dim=-1)
    picked = logprobs[:, :-1].gather(-1, windows[:, 1:, None]).squeeze(-1)
    return math.exp(-picked.mean().item()), windows.shape[0]


@pytest.mark.integration
def test_local_text_ppl_and_sparsity(tmp_path, sixty_model_dir, text_dir, offline):
    text_file = tmp_path / "macbeth.txt"
    text_file.write_text((text_dir / "macbeth.txt").read_text(encoding="utf-8")[:40000], encoding="utf-8")
    out, md = tmp_path / "result.json", tmp_path / "result.md"
    proc = run_entry("evaluate.py", ["--model", str(sixty_model_dir), "--ppl", str(text_file), "--seqlen", str(SEQLEN),
                                     "--batch_size", "4", "--output", str(out), "--markdown", str(md)], timeout=300)
    result = json.loads(out.read_text())

    expected, n_windows = independent_ppl(sixty_model_dir, text_file.read_text(encoding="utf-8"), SEQLEN)
    got = result["ppl"][str(text_file)]
    assert got["windows"] == n_windows > 10
    assert got["tokens"] == n_windows * (SEQLEN - 1)
    # fp32 on CPU agrees to ~1e-7; 1e-4 (not 0.5%) because on a random model dropping BOS moves ppl by only ~0.5%
    assert abs(got["ppl"] / expected - 1) < 1e-4, (got["ppl"], expected)

    assert result["seqlen"] == SEQLEN and result["protocol"]["bos_per_window"] is True
    assert result["dtype"] == "float32" and result["model_type"] == "gemma2"
    assert result["sparsity"]["pattern"] == "unstructured"
    assert abs(result["sparsity"]["overall"] - 0.6) < 1e-4
    assert {"elsa_ds", "torch", "transformers", "lm_eval"} <= set(result["versions"])
    assert result["tasks"] == {} and result["average_acc"] is None
    assert f"{got['ppl']:.3f}" in md.read_text() and f"{got['ppl']:.3f}" in proc.stdout
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_window_caps():
    assert max_windows("c4", None) == 256
    assert max_windows("c4", 1000) == 256
    assert max_windows("c4", 8) == 8
    assert max_windows("wikitext2", None) is None
    assert max_windows("/data/text.txt", 8) == 8
