"""Random crops reproduce the reference loaders call for call; crops make the same global batches on any number of ranks."""
from __future__ import annotations

import random

import pytest
import torch

from elsa_ds.data import Documents, GlobalBatches, elsa_crops, resolve_sampling, wanda_crops
from tests.conftest import play_text


def authors_process_and_tokenize(texts, stream, tokenizer, nsamples, seqlen, seed, is_gemma):
    """The ELSA authors' lib/data.py ``_process_and_tokenize``, transcribed (global random, as theirs)."""
    random.seed(seed)
    all_tokens = []
    if not stream:  # their "c4" branch
        for _ in range(nsamples):
            while True:
                i = random.randint(0, len(texts) - 1)
                tokens = tokenizer(texts[i], return_tensors="pt").input_ids
                if tokens.shape[1] > seqlen:
                    all_tokens.append(tokens)
                    break
    else:  # wikitext2
        all_tokens.append(tokenizer("\n\n".join(texts), return_tensors="pt").input_ids)
    samples = []
    for _ in range(nsamples):
        token_source = random.choice(all_tokens)
        slice_len = seqlen - 1 if is_gemma else seqlen
        start_index = random.randint(0, token_source.shape[1] - slice_len - 1)
        inp = token_source[:, start_index:start_index + slice_len]
        if is_gemma:
            inp = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), inp], dim=1)
        samples.append(inp.squeeze(0))
    return torch.stack(samples)


def wanda_get_c4_and_wikitext2(texts, stream, tokenizer, nsamples, seqlen, seed):
    """Wanda's lib/data.py ``get_c4`` / ``get_wikitext2`` training samples, transcribed."""
    random.seed(seed)
    samples = []
    if stream:
        trainenc = tokenizer(" ".join(texts), return_tensors="pt")
        for _ in range(nsamples):
            i = random.randint(0, trainenc.input_ids.shape[1] - seqlen - 1)
            samples.append(trainenc.input_ids[:, i:i + seqlen].squeeze(0))
        return torch.stack(samples)
    for _ in range(nsamples):
        while True:
            i = random.randint(0, len(texts) - 1)
            trainenc = tokenizer(texts[i], return_tensors="pt")
            if trainenc.input_ids.shape[1] > seqlen:
                break
        i = random.randint(0, trainenc.input_ids.shape[1] - seqlen - 1)
        samples.append(trainenc.input_ids[:, i:i + seqlen].squeeze(0))
    return torch.stack(samples)


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    """Documents of very different lengths: most shorter than a crop, some much longer (like C4 at seqlen 2048)."""
    paragraphs = play_text("macbeth").split("\n\n")
    rng = random.Random(1)
    docs, i = [], 0
    while i < len(paragraphs):
        n = rng.choice([1, 1, 2, 3, 40])
        docs.append("\n\n".join(paragraphs[i:i + n]))
        i += n
    return docs


@pytest.mark.parametrize("family", ["llama", "gemma"])
@pytest.mark.parametrize("stream", [False, True])
def test_crops_are_the_references_samples(corpus, llama_model_dir, gemma_bos_model_dir, family, stream):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_model_dir if family == "llama" else gemma_bos_model_dir)
    assert tok("x")["input_ids"][0] == tok.bos_token_id  # both tokenizers prepend BOS, as Llama's and Gemma's do
    state = random.getstate()
    try:
        docs = Documents(corpus, "test corpus", stream=stream)
        ours = elsa_crops(docs, tok, 24, 96, seed=5, bos_first=family == "gemma")
        assert torch.equal(ours, authors_process_and_tokenize(corpus, stream, tok, 24, 96, 5, family == "gemma"))
        calib = wanda_crops(docs, tok, 16, 96, seed=0)
        assert torch.equal(calib, wanda_get_c4_and_wikitext2(corpus, stream, tok, 16, 96, 0))
    finally:
        random.setstate(state)
    assert ours.shape == (24, 96) and ours.dtype == torch.long
    if family == "gemma":
        assert (ours[:, 0] == tok.bos_token_id).all()
    else:  # seqlen raw tokens of tokenizer(document): BOS only where a crop starts at the document's start
        assert (ours[:, 0] == tok.bos_token_id).sum() < ours.shape[0]
    assert not torch.equal(ours, elsa_crops(docs, tok, 24, 96, seed=6, bos_first=family == "gemma"))


def test_crop_global_batches_identical_on_one_and_two_ranks(corpus, gemma_bos_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_bos_model_dir)
    steps, global_batch = 5, 8
    crops = [elsa_crops(Documents(corpus, "c"), tok, steps * global_batch, 64, seed=3, bos_first=True) for _ in range(2)]
    assert torch.equal(crops[0], crops[1])  # what every rank computes on its own
    for step in range(steps):
        one = torch.cat(GlobalBatches(crops[0], global_batch, 2, 1, 0, seed=3).micro_batches(step))
        two = torch.cat([torch.cat(GlobalBatches(crops[r], global_batch, 2, 2, r, seed=3).micro_batches(step)) for r in range(2)])
        assert torch.equal(one, two)


def test_auto_sampling():
    assert resolve_sampling("auto", "c4").value == resolve_sampling("auto", "wikitext2").value == "crop"
    assert resolve_sampling("auto", "shakespeare").value == resolve_sampling("auto", "/data/book.txt").value == "pack"
    assert resolve_sampling("pack", "c4").value == "pack"
