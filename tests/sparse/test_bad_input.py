"""Bad input through the real entry point (launch/compress.py): one `elsa_ds: error` line, exit 2, nothing half-written;
and the same problems through the Python loader as ElsaError."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from elsa_ds.errors import ElsaError
from elsa_ds.sparse import from_pretrained
from tests.conftest import run_entry, run_fails
from tests.sparse.conftest import DEMO


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _truncated(sparse_dir, tmp_path):
    bad = _copy(sparse_dir, tmp_path)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    return bad


def _count_mismatch(sparse_dir, tmp_path):
    bad = _copy(sparse_dir, tmp_path)
    tensors = load_file(bad / "model.safetensors")
    name = next(n for n in tensors if n.endswith(".values"))
    tensors[name] = tensors[name][:-3].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


def _version(sparse_dir, tmp_path):
    bad = _copy(sparse_dir, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["elsa_sparse"]["version"] = 99
    (bad / "config.json").write_text(json.dumps(config))
    return bad


BROKEN = {"truncated": (_truncated, "truncated or corrupt"), "count": (_count_mismatch, "corrupt"),
          "version": (_version, "format version 99")}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_checkpoint_fails_verify_and_load(sparse_dir, tmp_path, kind):
    make, needle = BROKEN[kind]
    bad = make(sparse_dir, tmp_path)
    run_fails("compress.py", ["--verify", str(bad)], needle)
    with pytest.raises(ElsaError, match=needle):
        from_pretrained(bad, mode="sparse")


def test_dense_folder_is_not_a_sparse_checkpoint(pruned_dir):
    run_fails("compress.py", ["--verify", str(pruned_dir)], "not an elsa-sparse checkpoint")
    with pytest.raises(ElsaError, match="not an elsa-sparse checkpoint"):
        from_pretrained(pruned_dir, mode="dense")


def test_unpruned_input_has_nothing_to_compress(tmp_path):
    run_fails("compress.py", [str(DEMO), str(tmp_path / "out")], "nothing would get smaller")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_sparse_input_is_refused(sparse_dir, tmp_path):
    run_fails("compress.py", [str(sparse_dir), str(tmp_path / "out")], "already an elsa-sparse checkpoint")


def test_truncated_input_leaves_nothing(pruned_dir, tmp_path):
    bad = _truncated(pruned_dir, tmp_path)
    run_fails("compress.py", [str(bad), str(tmp_path / "out")], "truncated or corrupt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # no output, no staging folder


def test_existing_output_needs_overwrite(pruned_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    run_fails("compress.py", [str(pruned_dir), str(out)], "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"
    run_entry("compress.py", [str(pruned_dir), str(out), "--overwrite"])
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    run_entry("compress.py", ["--verify", str(out)])


def test_output_inside_input_is_refused(pruned_dir, tmp_path):
    src = _copy(pruned_dir, tmp_path)
    before = sorted(p.name for p in src.iterdir())
    run_fails("compress.py", [str(src), str(src / "sparse")], "inside the input")
    run_fails("compress.py", [str(src), str(src)], "inside the input")
    run_fails("compress.py", [str(src), str(tmp_path), "--overwrite"], "contains the input")
    assert sorted(p.name for p in src.iterdir()) == before


def test_bad_mode_is_refused(sparse_dir):
    with pytest.raises(ElsaError, match="mode"):
        from_pretrained(sparse_dir, mode="fast")
