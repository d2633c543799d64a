"""speed.measure on the pruned demo: bytes consistent with the checkpoint, floors from the bytes, agreement, ratios."""
from __future__ import annotations

from elsa_ds.sparse import speed
from elsa_ds.sparse.folder import TensorReader


def test_measure_reports_bytes_floors_and_ratios(sparse_dir):
    result = speed.measure(sparse_dir, batches=(1, 2), steps=2, rounds=2, prompt=4, bandwidth=10e9)
    disk = result["disk"]
    reader = TensorReader(sparse_dir, sparse=True)
    stored = sum(reader.get(n).numel() * reader.get(n).element_size() for n in reader.names)
    assert disk["model_sparse"] == stored and disk["pruned_sparse"] < 0.5 * disk["pruned_dense"]
    assert disk["model_dense"] - disk["pruned_dense"] == disk["model_sparse"] - disk["pruned_sparse"]
    assert result["logits_max_rel_err"] <= 1e-3
    for row, batch in zip(result["decode"], (1, 2)):
        assert row["batch"] == batch and row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        for mode in ("dense", "sparse"):
            assert row[mode]["tokens_per_s"] > 0
            assert abs(row[mode]["floor_tokens_per_s"] - batch * 10e9 / row[mode]["bytes_per_step"]) < 1e-6
        assert row["sparse"]["bytes_per_step"] < row["dense"]["bytes_per_step"]


def test_tensor_bytes_counts_tied_weights_once_and_prefill_floor(sparse_dir):
    from elsa_ds.sparse.loader import from_pretrained

    dense, sparse = from_pretrained(sparse_dir, "dense"), from_pretrained(sparse_dir, "sparse")
    assert dense.lm_head.weight.data_ptr() == dense.model.embed_tokens.weight.data_ptr()
    params = {p.data_ptr(): p.numel() * p.element_size() for p in [*dense.parameters(), *dense.buffers()]}
    assert speed.tensor_bytes(dense) == sum(params.values()) < sum(p.numel() * p.element_size() for p in dense.state_dict().values())
    assert speed.tensor_bytes(sparse) < speed.tensor_bytes(dense)
    row = speed.compare_prefill(dense, sparse, batch=2, prompt=5, rounds=2, bandwidth=10e9)
    assert row["batch"] == 2 and row["prompt"] == 5 and row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    for mode, model in (("dense", dense), ("sparse", sparse)):
        assert row[mode]["bytes_per_step"] == speed.streamed_bytes(model)
        assert abs(row[mode]["floor_tokens_per_s"] - 2 * 5 * 10e9 / row[mode]["bytes_per_step"]) < 1e-6
