from __future__ import annotations

import json
import re

import pytest
import torch

from elsa_ds.data import GlobalBatches, iter_texts, pack_blocks
from elsa_ds.errors import ElsaError


def test_pack_blocks_bos_per_block_eos_between_docs():
    blocks = pack_blocks([[10, 11, 12], [20, 21], [30, 31, 32, 33]], seqlen=4, bos_id=2, eos_id=1)
    # stream: 10 11 12 1 20 21 1 30 31 32 33 1 -> bodies of 3 tokens, each after BOS
    assert blocks.tolist() == [[2, 10, 11, 12], [2, 1, 20, 21], [2, 1, 30, 31], [2, 32, 33, 1]]
    assert pack_blocks([[1, 2, 3, 4, 5]], seqlen=2, bos_id=None, eos_id=None).tolist() == [[1, 2], [3, 4]]
    assert pack_blocks([[1, 2, 3]], seqlen=3, bos_id=9, eos_id=0, max_blocks=1).shape == (1, 3)


def test_global_batches_identical_for_any_world_size():
    blocks = torch.arange(40 * 3).view(40, 3)
    one = GlobalBatches(blocks, global_batch=8, micro_batch=2, world_size=1, rank=0, seed=5)
    for step in (0, 4, 7):  # step 7 is in the second epoch (5 batches per epoch)
        whole = torch.cat(one.micro_batches(step))
        two = torch.cat([torch.cat(GlobalBatches(blocks, 8, 2, 2, r, 5).micro_batches(step)) for r in range(2)])
        four = torch.cat([torch.cat(GlobalBatches(blocks, 8, 1, 4, r, 5).micro_batches(step)) for r in range(4)])
        assert torch.equal(whole, two) and torch.equal(whole, four)
    assert one.grad_accum == 4
    epoch0 = torch.cat([one.global_batch_at(s) for s in range(5)])
    assert sorted(epoch0[:, 0].tolist()) == list(range(0, 120, 3))  # an epoch visits every block once
    # the epoch's order is drawn once and kept: steps asked out of order (a resumed run) get what fresh objects give
    for step in (7, 2, 9, 7, 0):
        assert torch.equal(one.global_batch_at(step), GlobalBatches(blocks, 8, 2, 1, 0, 5).global_batch_at(step))
    first = one.global_batch_at(5)  # epoch 1's first batch differs from epoch 0's: the seed moves with the epoch
    assert not torch.equal(first, one.global_batch_at(0))


def test_too_few_blocks_for_one_global_batch():
    with pytest.raises(ElsaError, match="fewer than one global batch"):
        GlobalBatches(torch.zeros(3, 4, dtype=torch.long), 8, 1, 1, 0, 0)


def test_local_txt_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    pq.write_table(pa.table({"text": ["three"]}), tmp_path / "c.parquet")
    # every document (no file names a split; training with a --val_dataset, or launch/evaluate.py --ppl DIR)
    assert list(iter_texts(str(tmp_path), "train", holdout_part=False)) == ["plain text", "one", "two", "three"]
    held = list(iter_texts(str(tmp_path), "validation"))   # otherwise whole documents are held out, never trained on
    assert held and not set(held) & set(iter_texts(str(tmp_path), "train"))
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ElsaError, match="no 'text' field"):
        list(iter_texts(str(tmp_path / "d.jsonl"), "train"))


def test_a_corpus_text_that_is_not_text_is_refused_and_a_null_is_no_document(tmp_path):
    """An audit: ``str()`` made a null text "None", bytes "b'...'" and a list "['a']", and a run trained on them, exit 0
    (a binary Parquet column scored 2,013 where its text as strings scored 307). A null is no document, as a
    ``datasets`` corpus's None is; anything else but a string is refused, naming the file and the line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [{"text": "one"}, {"text": None}, {"text": "two"}]
    (tmp_path / "nulls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert list(iter_texts(str(tmp_path / "nulls.jsonl"), "train", holdout_part=False)) == ["one", "two"]
    for n, value in enumerate((12345, ["a list"], {"title": "x"}, True), 1):
        (path := tmp_path / f"bad{n}.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(ElsaError, match=re.escape(f"bad{n}.jsonl:2: its 'text' is {json.dumps(value)}, not a string")):
            list(iter_texts(str(path), "train", holdout_part=False))
    pq.write_table(pa.table({"text": pa.array(["three", None, "four"])}), tmp_path / "nulls.parquet")
    assert list(iter_texts(str(tmp_path / "nulls.parquet"), "train", holdout_part=False)) == ["three", "four"]
    for name, column in (("binary", pa.array([b"three"])), ("numbers", pa.array([0, 1, 2]))):
        pq.write_table(pa.table({"text": column}), tmp_path / f"{name}.parquet")
        with pytest.raises(ElsaError, match=f"{name}.parquet: its 'text' column holds {column.type}, not a string"):
            list(iter_texts(str(tmp_path / f"{name}.parquet"), "train", holdout_part=False))


def test_a_parquet_file_that_expands_past_its_cap_is_refused_before_its_rows_are_built(tmp_path):
    """A Parquet file is data from elsewhere: its text is sized from the file's own metadata and its dictionary's lengths
    before any row becomes a string (a 1 KB file naming one 16 MiB string 64 times took 21 GB, a sixth audit). A
    dictionary of short repeated strings, as real files hold, still reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    big = pa.array(["a" * (16 * 2**20)])
    repeated = pa.DictionaryArray.from_arrays(pa.array([0] * 8, pa.int32()), big)  # 128 MiB of text in one 16 MiB entry
    pq.write_table(pa.table({"text": repeated}), tmp_path / "dict.parquet", compression="zstd")
    pq.write_table(pa.table({"text": pa.array(["a" * (100 * 2**20)])}), tmp_path / "plain.parquet", compression="zstd",
                   use_dictionary=False)  # declared 100 MiB uncompressed: refused before reading
    for name, size in (("dict", 8 * 16 * 2**20), ("plain", 100 * 2**20)):
        path = tmp_path / f"{name}.parquet"
        assert path.stat().st_size < 2**20
        with pytest.raises(ElsaError, match=r"holds [\d,]+ bytes or more .*, over .* refused as a decompression bomb") as err:
            list(iter_texts(str(path), "train", holdout_part=False))
        assert size <= int(str(err.value).split(" holds ")[1].split()[0].replace(",", "")) < size + 2**10  # headers
    pq.write_table(pa.table({"text": pa.array([""] * 3_000_000)}), tmp_path / "rows.parquet")  # 3M empty rows: ~0.2 GB
    with pytest.raises(ElsaError, match="refused as a decompression bomb"):
        list(iter_texts(str(tmp_path / "rows.parquet"), "train", holdout_part=False))
    url = pa.array([{"source": "https://example.org/" + "x" * 2000}] * 400)  # a review: another column's leaves were measured
    pq.write_table(pa.table({"meta": url, "text": pa.array([str(i) for i in range(400)]), "n": list(range(400))}),
                   tmp_path / "struct.parquet")
    assert list(iter_texts(str(tmp_path / "struct.parquet"), "train", holdout_part=False)) == [str(i) for i in range(400)]
    words = pa.DictionaryArray.from_arrays(pa.array([i % 3 for i in range(5000)], pa.int32()), pa.array(["to", "be", "or"]))
    pq.write_table(pa.table({"text": words, "id": list(range(5000))}), tmp_path / "ok.parquet", row_group_size=1000)
    assert list(iter_texts(str(tmp_path / "ok.parquet"), "train", holdout_part=False)) == ["to", "be", "or"] * 1666 + ["to", "be"]


def test_unknown_source_is_an_error():
    with pytest.raises(ElsaError):
        list(iter_texts("./no/such/file.txt", "train"))
    with pytest.raises(ElsaError, match="no such file"):
        list(iter_texts("missing.jsonl", "validation"))
