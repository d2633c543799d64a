"""A sparse checkpoint is data from elsewhere: its index never reaches outside its folder, every tensor and config.json
are held to the checksums recorded when it was written (a moved bitmask bit is refused), version 1 loads unverified
with a warning, and ``verify=False`` skips the checksums."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from elsa_ds.errors import ElsaError
from elsa_ds.sparse import SparseCheckpointError, from_pretrained, verify
from tests.sparse.conftest import SPARSE_FILE, SPARSE_INDEX, SPARSE_SHARDS, as_model_named, tiny_pruned

INDEX = SPARSE_INDEX


def _copy(src, dst):
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _rewrite(shard, change):
    """Load a shard's tensors, ``change`` them (a dict, in place), write it back with its header metadata."""
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, metadata=metadata)


def _shard_of(folder, name):
    return folder / json.loads((folder / INDEX).read_text())["weight_map"][name]


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _outside_by_name(ckpt, elsewhere, absolute):
    index = json.loads((ckpt / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    elsewhere.mkdir()
    shutil.move(ckpt / shard, elsewhere / shard)  # a valid shard, only somewhere else
    named = str(elsewhere / shard) if absolute else f"../{elsewhere.name}/{shard}"
    index["weight_map"] = {k: named if v == shard else v for k, v in index["weight_map"].items()}
    (ckpt / INDEX).write_text(json.dumps(index))
    return named


def _outside_by_link(ckpt, elsewhere, absolute):
    shard = sorted(set(json.loads((ckpt / INDEX).read_text())["weight_map"].values()))[0]
    elsewhere.mkdir()
    shutil.move(ckpt / shard, elsewhere / shard)
    os.symlink(elsewhere / shard if absolute else f"../{elsewhere.name}/{shard}", ckpt / shard)
    return shard


@pytest.mark.parametrize("how", ["relative", "absolute", "link", "absolute_link"])
def test_a_shard_outside_the_folder_is_refused(tiny_sparse_dir, tmp_path, how):
    ckpt = _copy(tiny_sparse_dir, tmp_path / "ckpt")
    make = _outside_by_link if how.endswith("link") else _outside_by_name
    named = make(ckpt, tmp_path / "elsewhere", how.startswith("absolute"))
    for load in (verify, lambda p: from_pretrained(p, mode="sparse"), lambda p: from_pretrained(p, verify=False)):
        with pytest.raises(SparseCheckpointError, match="must lie inside") as err:
            load(ckpt)
        where = ckpt if how.endswith("link") else ckpt / INDEX  # a link is refused by the folder's check, first
        assert f"{where}: " in str(err.value) and repr(named) in str(err.value) and "\n" not in str(err.value)


def test_a_single_file_linked_outside_is_refused(tmp_path):
    from elsa_ds.sparse import compress

    ckpt = tmp_path / "ckpt"
    compress(tiny_pruned(tmp_path / "pruned"), ckpt)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(ckpt / SPARSE_FILE, tmp_path / "elsewhere" / SPARSE_FILE)
    os.symlink(tmp_path / "elsewhere" / SPARSE_FILE, ckpt / SPARSE_FILE)
    with pytest.raises(SparseCheckpointError, match=f"'{SPARSE_FILE}' is a link to .*outside"):
        from_pretrained(ckpt)


def test_compress_never_copies_a_file_linked_from_outside_its_input(tmp_path):
    """compress copies the input's other files (tokenizer, generation config) into its output: a link among them to a
    file outside the folder (an audit's find, 2026-11-30) would have copied that file's content in. Refused up front."""
    from elsa_ds.sparse import compress

    pruned, secret = tiny_pruned(tmp_path / "pruned"), tmp_path / "secret.txt"
    secret.write_text("not the model's")
    (pruned / "notes.txt").symlink_to(secret)
    with pytest.raises(SparseCheckpointError, match=r"'notes.txt' is a link to .*outside"):
        compress(pruned, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_the_hub_cache_layout_still_loads(tiny_sparse_dir, tmp_path):
    """huggingface_hub's snapshot files are links into the repository's blobs/: inside the download, so allowed."""
    repo = tmp_path / "models--someone--tiny-sparse"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in tiny_sparse_dir.iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        os.symlink(f"../../blobs/blob-{f.name}", snapshot / f.name)
    assert torch.equal(from_pretrained(snapshot).lm_head.weight, from_pretrained(tiny_sparse_dir).lm_head.weight)


def test_a_cached_hub_id_of_a_sparse_checkpoint_is_refused_as_its_folder_is(tiny_sparse_dir, tmp_path, monkeypatch):
    """A review (2026-12-04): an elsa-sparse checkpoint named by hub id (in this machine's cache) passed the check that
    refuses its folder as --model, and transformers then found no weights. The cache's snapshot is judged as the folder."""
    from huggingface_hub import constants

    from elsa_ds.models import refuse_sparse_checkpoint

    repo = tmp_path / "hub" / "models--someone--tiny-sparse"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    for f in tiny_sparse_dir.iterdir():
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        os.symlink(f"../../blobs/blob-{f.name}", snapshot / f.name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ElsaError, match="--model someone/tiny-sparse is an elsa-sparse checkpoint"):
        refuse_sparse_checkpoint("someone/tiny-sparse", "--model")
    refuse_sparse_checkpoint("someone/not-cached", "--model")  # not here: transformers' to download


def test_only_a_download_s_own_blobs_are_followed(tmp_path):
    """Any ``*/models--*/blobs/*`` file was accepted as a link's target (a trust leftover, 2026-11-30): a snapshot may
    link only into its own repository's blobs/, and a folder outside the cache (an old ``local_dir`` download) only to a
    blob named by its etag; anything else in some folder named ``models--x/blobs`` is refused like any outside file."""
    from elsa_ds.files.weight_files import within
    from elsa_ds.sparse import compress

    whole = tmp_path / "whole"
    compress(tiny_pruned(tmp_path / "pruned"), whole)
    other = tmp_path / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    etag = "ab" * 32
    for name in (SPARSE_FILE, etag):
        shutil.copy(whole / SPARSE_FILE, other / name)
    snapshot = tmp_path / "models--someone--tiny-sparse" / "snapshots" / "0123abc"
    local = tmp_path / "local_dir"
    for folder in (snapshot, local):
        _copy(whole, folder)
        (folder / SPARSE_FILE).unlink()
        (folder / SPARSE_FILE).symlink_to(other / SPARSE_FILE)
        with pytest.raises(SparseCheckpointError, match=f"'{SPARSE_FILE}' is a link to .*outside"):
            from_pretrained(folder)
    assert not within(snapshot.resolve(), (other / etag).resolve())  # another repository's blob, whatever its name
    (local / SPARSE_FILE).unlink()
    (local / SPARSE_FILE).symlink_to(other / etag)
    assert torch.equal(from_pretrained(local).lm_head.weight, from_pretrained(whole).lm_head.weight)
    assert not within(local.resolve(), (tmp_path / "models--x" / "blobs" / ("0" * 63)).resolve())


def _move_one_bit(name):
    """Within one byte of bitmask ``name``, clear a set bit and set a clear one: the count is unchanged, the model not."""
    def change(tensors):
        flat = tensors[name].view(-1)
        i = next(i for i in range(flat.numel()) if 0 < int(flat[i]) < 0xFF)
        byte = int(flat[i])
        set_bit, clear_bit = next(b for b in range(8) if byte >> b & 1), next(b for b in range(8) if not byte >> b & 1)
        flat[i] = byte & ~(1 << set_bit) | (1 << clear_bit)
    return change


def test_a_moved_bitmask_bit_is_refused_and_verify_false_skips_the_check(tiny_sparse_dir, tmp_path):
    ckpt = _copy(tiny_sparse_dir, tmp_path / "ckpt")
    name = "model.layers.0.self_attn.q_proj.weight.bitmask"  # 16 columns: every bit of every byte is a column
    _rewrite(_shard_of(ckpt, name), _move_one_bit(name))
    for load in (verify, lambda p: from_pretrained(p, mode="dense"), lambda p: from_pretrained(p, mode="sparse")):
        with pytest.raises(SparseCheckpointError, match=r"q_proj\.weight\.bitmask does not match its recorded checksum"):
            load(ckpt)
    moved = from_pretrained(ckpt, verify=False)  # what the structural checks alone let through: another model
    original = from_pretrained(tiny_sparse_dir)
    assert not torch.equal(moved.model.layers[0].self_attn.q_proj.weight, original.model.layers[0].self_attn.q_proj.weight)


def test_two_tensors_swapped_by_name_are_refused(tiny_sparse_dir, tmp_path):
    """Same shard, shape and dtype: only the name in each digest tells them apart."""
    ckpt = _copy(tiny_sparse_dir, tmp_path / "ckpt")
    for shard in sorted(ckpt.glob(SPARSE_SHARDS)):
        tensors = load_file(shard)
        pairs = [(a, b) for a in tensors for b in tensors if a < b and tensors[a].shape == tensors[b].shape
                 and tensors[a].dtype == tensors[b].dtype and not torch.equal(tensors[a], tensors[b])]
        if pairs:
            a, b = pairs[0]
            _rewrite(shard, lambda t: t.update({a: t[b], b: t[a]}))
            break
    else:
        pytest.fail("no shard holds two tensors of one shape")
    with pytest.raises(SparseCheckpointError, match="does not match its recorded checksum"):
        from_pretrained(ckpt)


def test_an_edited_config_is_refused(tiny_sparse_dir, tmp_path):
    ckpt = _copy(tiny_sparse_dir, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["rms_norm_eps"] = 0.5  # loads fine, computes something else
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(SparseCheckpointError, match="config.json: does not match the checksum"):
        from_pretrained(ckpt)
    assert from_pretrained(ckpt, verify=False).config.rms_norm_eps == 0.5
    config["rms_norm_eps"] = json.loads((tiny_sparse_dir / "config.json").read_text())["rms_norm_eps"]
    (ckpt / "config.json").write_text(json.dumps(config, indent=7))  # the same content in another layout
    from_pretrained(ckpt)


def test_version_1_loads_unverified_with_a_warning(tiny_sparse_dir, tmp_path, capsys):
    ckpt = _copy(tiny_sparse_dir, tmp_path / "ckpt")
    as_model_named(ckpt, version=1)
    capsys.readouterr()
    loaded = from_pretrained(ckpt, mode="dense")
    warned = capsys.readouterr().err
    assert "elsa_ds: warning:" in warned and "format version 1 records no checksums" in warned and "unverified" in warned
    reference = _state(from_pretrained(tiny_sparse_dir))
    assert all(torch.equal(t, reference[k]) for k, t in loaded.state_dict().items())


def test_a_version_flipped_to_1_or_a_missing_checksum_is_refused(tiny_sparse_dir, tmp_path):
    ckpt = _copy(tiny_sparse_dir, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["elsa_sparse"]["version"] = 1  # a checksum block that version 1 never wrote
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(SparseCheckpointError, match="version 1 with a checksum block"):
        from_pretrained(ckpt, verify=False)
    config["elsa_sparse"]["version"] = 2
    del config["elsa_sparse"]["checksum"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(SparseCheckpointError, match="checksum: missing"):
        from_pretrained(ckpt)


def test_a_bin_swapped_after_its_check_is_not_the_one_read(tmp_path, monkeypatch):
    """The zip check and torch's read go through one handle: a file put at the name after the check is never loaded."""
    from elsa_ds.files import torch_files
    from elsa_ds.sparse.folder import TensorReader

    folder = tmp_path / "model"
    folder.mkdir()
    torch.save({"w": torch.ones(4)}, folder / "pytorch_model.bin")
    torch.save({"w": torch.full((4,), 7.0)}, tmp_path / "other.bin")
    checked = torch_files.zip_problem

    def check_then_swap(file):
        problem = checked(file)
        os.replace(tmp_path / "other.bin", folder / "pytorch_model.bin")
        return problem

    monkeypatch.setattr(torch_files, "zip_problem", check_then_swap)
    assert torch.equal(TensorReader(folder).get("w"), torch.ones(4))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.safetensors"])
def test_a_link_out_put_there_after_the_folder_check_is_refused(tmp_path, monkeypatch, name):
    """A weight file replaced by a link outside the folder between the folder's check and the file's opening is
    refused at the opening (it was followed and read)."""
    import elsa_ds.sparse.folder as folder_module

    folder, outside = tmp_path / "model", tmp_path / f"outside-{name}"
    folder.mkdir()
    state = {"w": torch.ones(4)}
    for path in (folder / name, outside):
        torch.save(state, path) if name.endswith(".bin") else save_file(state, path)
    located = folder_module.locate

    def locate_then_link(*args, **kwargs):
        found = located(*args, **kwargs)
        (folder / name).unlink()
        (folder / name).symlink_to(outside)
        return found

    monkeypatch.setattr(folder_module, "locate", locate_then_link)
    with pytest.raises(SparseCheckpointError, match="outside"):
        folder_module.TensorReader(folder)


def test_a_safetensors_file_replaced_while_read_is_still_the_one_opened(tmp_path):
    """The reader keeps the file it opened: tensors read after the name was given another file are the opened one's."""
    from elsa_ds.sparse.folder import TensorReader

    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(4)}, folder / "model.safetensors")
    reader = TensorReader(folder)
    save_file({"w": torch.full((4,), 7.0)}, tmp_path / "other.safetensors")
    os.replace(tmp_path / "other.safetensors", folder / "model.safetensors")
    assert torch.equal(reader.get("w"), torch.ones(4))


def test_a_folder_on_the_way_swapped_for_a_link_after_the_check_is_refused(tmp_path, monkeypatch):
    """The last component is opened without following a link; a folder before it replaced by a link out between the
    check and the opening is caught from where the opened file really is (a trust audit, 2026-11-30)."""
    import elsa_ds.sparse.folder as folder_module

    folder, outside = tmp_path / "model", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    outside.mkdir()
    for where in (folder / "sub", outside):
        save_file({"w": torch.ones(4)}, where / "weights.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "sub/weights.safetensors"}}))
    checked = folder_module.checked_target

    def check_then_swap(*args, **kwargs):
        target = checked(*args, **kwargs)
        shutil.rmtree(folder / "sub")
        (folder / "sub").symlink_to(outside)
        return target

    monkeypatch.setattr(folder_module, "checked_target", check_then_swap)
    with pytest.raises(SparseCheckpointError, match="outside"):
        folder_module.TensorReader(folder)
