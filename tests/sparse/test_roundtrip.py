"""A magnitude-pruned demo model through compress and back: dense mode bit for bit, sparse mode's logits and greedy
tokens, the bytes saved, and every input layout (safetensors, sharded, pytorch_model.bin)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from elsa_ds.sparse import compress, from_pretrained, verify
from elsa_ds.sparse.compress import CARD_BYTES
from elsa_ds.sparse.integrity import SparseCheckpointError
from elsa_ds.sparse.folder import TensorReader
from elsa_ds.sparse.linear import SparseLinear
from tests.sparse.conftest import SPARSE_FILE, SPARSE_INDEX, SPARSE_SHARDS, pruned_demo


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_dense_export_equal(pruned_dir, model) -> None:
    state = model.state_dict()
    reader = TensorReader(pruned_dir)
    for name in reader.names:
        stored = reader.get(name)
        assert state[name].dtype == stored.dtype and torch.equal(_bits(state[name]), _bits(stored)), name


def test_dense_mode_equals_the_dense_export_bit_for_bit(pruned_dir, sparse_dir):
    model = from_pretrained(sparse_dir, mode="dense")
    _assert_dense_export_equal(pruned_dir, model)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_sparse_mode_logits_and_greedy_tokens(sparse_dir):
    dense = from_pretrained(sparse_dir, mode="dense")
    sparse = from_pretrained(sparse_dir, mode="sparse")
    replaced = [m for m in sparse.modules() if isinstance(m, SparseLinear)]
    assert len(replaced) == 4 * 7 and all(m.decode_path in ("kernel", "csr") for m in replaced)
    assert not any(type(m) is torch.nn.Linear for n, m in sparse.named_modules() if ".layers." in n)
    prompt = torch.tensor([[2, 310, 45, 1002, 77, 9, 400, 12]])
    with torch.no_grad():
        for ids in (prompt, prompt.repeat(1, 4)):  # 8 rows: the decode kernel; 32 rows: decompress and matmul
            a, b = dense(ids).logits, sparse(ids).logits
            assert float((b - a).abs().max() / a.abs().max()) <= 1e-3
    tokens_dense = dense.generate(prompt, max_new_tokens=24, do_sample=False)
    tokens_sparse = sparse.generate(prompt, max_new_tokens=24, do_sample=False)
    assert tokens_dense.shape[1] == prompt.shape[1] + 24 and torch.equal(tokens_dense, tokens_sparse)
    assert len(set(tokens_dense[0, 8:].tolist())) > 3  # the pruned demo still writes, not one repeated token


def test_sizes_of_the_pruned_demo(pruned_dir, sparse_dir, tmp_path):
    reader = TensorReader(sparse_dir, sparse=True)
    assert any(n.endswith(".bitmask") for n in reader.names)  # 60 % in fp32: the bitmask is smaller
    files = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    # 60 % of the decoder weights in fp32 (4 bytes + 1/8 byte of bitmask per kept weight), the embedding dense
    assert files(sparse_dir) < 0.6 * files(pruned_dir)
    # at 90 % in bf16, the pruned weights take at most 0.2x their dense bytes
    done = compress(pruned_demo(tmp_path / "bf16-90", 0.9, torch.bfloat16), tmp_path / "bf16-90-sparse")
    assert done["pruned_bytes"] <= 0.2 * done["pruned_dense_bytes"]
    assert done["output_bytes"] < 0.5 * done["input_bytes"]
    assert sorted(p.name for p in (tmp_path / "bf16-90-sparse").iterdir()) == sorted(
        ["config.json", "generation_config.json", SPARSE_FILE, "tokenizer.json", "tokenizer_config.json", "README.md"])
    assert verify(tmp_path / "bf16-90-sparse")["plain"] > 0


def test_the_checkpoint_says_how_to_load_it_after_the_inputs_own_card(pruned_dir, sparse_dir, tmp_path):
    """transformers stops on a sparse folder with its own error: the folder's model card names the loader."""
    card = (sparse_dir / "README.md").read_text()
    assert card.startswith("# An elsa-sparse checkpoint")
    assert 'elsa_ds.sparse.from_pretrained("PATH", mode="dense")' in card and "elsa-compress --verify" in card
    assert f"each of its {len(json.loads((sparse_dir / 'config.json').read_text())['elsa_sparse']['tensors'])} compressed" in card
    own = shutil.copytree(pruned_dir, tmp_path / "carded")
    (own / "readme.md").write_text("# the user's model card\nUse AutoModelForCausalLM.")  # any case, no final newline
    compress(own, tmp_path / "carded-sparse")
    names = [p.name for p in (tmp_path / "carded-sparse").iterdir() if p.name.lower() == "readme.md"]
    assert names == ["readme.md"]  # one card, under the input's name
    text = (tmp_path / "carded-sparse" / "readme.md").read_text()
    assert text.startswith("# the user's model card\nUse AutoModelForCausalLM.\n\n## An elsa-sparse checkpoint\n")
    assert (own / "readme.md").read_text() == "# the user's model card\nUse AutoModelForCausalLM."  # the input untouched


def test_a_card_that_is_no_card_is_refused_before_any_weight_is_written(pruned_dir, tmp_path):
    """The input's card is data: read once, without following a link at its name, at most CARD_BYTES of UTF-8 text; a
    link to the folder's own weights, a huge or UTF-16 file, or two cards in other cases are refused (a review found each
    read whole or written mixed); with README.md among the variants, README.md (the hub's) is the one extended."""
    cases = {"weights": lambda d: (d / "README.md").symlink_to("model.safetensors"),
             "huge": lambda d: (d / "README.md").write_bytes(b"#" * (CARD_BYTES + 1)),
             "utf16": lambda d: (d / "README.md").write_bytes("# card".encode("utf-16")),
             "two": lambda d: ((d / "readme.md").write_text("a"), (d / "Readme.md").write_text("b"))}
    for name, make in cases.items():
        src = shutil.copytree(pruned_dir, tmp_path / name)
        make(src)
        with pytest.raises(SparseCheckpointError, match="model card|UTF-8|more than"):
            compress(src, tmp_path / f"{name}-sparse")
        assert not (tmp_path / f"{name}-sparse").exists(), name
    both = shutil.copytree(pruned_dir, tmp_path / "both")
    (both / "README.md").write_text("# the hub's card\n")
    (both / "readme.md").write_text("# another\n")
    compress(both, tmp_path / "both-sparse")
    assert (tmp_path / "both-sparse" / "README.md").read_text().startswith("# the hub's card\n\n## An elsa-sparse checkpoint")
    assert (tmp_path / "both-sparse" / "readme.md").read_text() == "# another\n"  # copied as it was


def test_sharded_and_bin_inputs_and_sharded_output(pruned_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pruned_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="3MB")
    (tmp_path / "bin").mkdir()
    torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((pruned_dir / "config.json").read_text())
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    for name in ("sharded", "bin"):
        out = tmp_path / f"{name}-sparse"
        compress(tmp_path / name, out, max_shard_size="1MB")
        assert (out / SPARSE_INDEX).is_file() and len(list(out.glob(SPARSE_SHARDS))) > 1
        _assert_dense_export_equal(pruned_dir, from_pretrained(out, mode="dense"))
    assert not list(tmp_path.glob(".*partial"))


def test_dtype_override(sparse_dir):
    model = from_pretrained(sparse_dir, mode="sparse", dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(m.values.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, SparseLinear))
