"""Format version 3 of the elsa-sparse checkpoint: its weight files are elsa-sparse*.safetensors and its shard index
elsa-sparse.shards.json, names neither transformers nor accelerate reads, so their loaders stop with an error where
version 2's model*.safetensors had them build every pruned weight at random with only a warning (a user's walk: 5019
for a model whose dense export scores 69). Version 2 (data/v2_sharded: written by elsa_ds at 2b95253, the last to
write it) still loads; a folder mixing the layouts, or a version 3 index naming other files, is refused in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from elsa_ds.models import is_sparse_checkpoint
from elsa_ds.sparse import SparseCheckpointError, compress, from_pretrained, verify
from elsa_ds.sparse.meta import seal
from tests.sparse.conftest import SPARSE_FILE, SPARSE_INDEX, SPARSE_SHARDS, as_model_named, tiny_pruned

V2 = Path(__file__).resolve().parent / "data" / "v2_sharded"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The tiny model's sparse checkpoint as one file."""
    root = tmp_path_factory.mktemp("single")
    return Path(compress(tiny_pruned(root / "pruned"), root / "sparse") and root / "sparse")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_transformers_and_accelerate_find_no_weights_in_a_version_3_checkpoint(single, tiny_sparse_dir, layout):
    """Every loader a user may try stops with an error; the config still loads (the folder is the model's folder
    with other weight files). accelerate's load_checkpoint_in_model takes a folder's one *.index.json: the index's
    own name keeps it out."""
    from accelerate import load_checkpoint_in_model
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = single if layout == "single" else tiny_sparse_dir
    assert (ckpt / SPARSE_FILE).is_file() == (layout == "single") and (ckpt / SPARSE_INDEX).is_file() == (layout == "sharded")
    for kwargs in ({}, {"use_safetensors": True}, {"use_safetensors": False}):
        with pytest.raises(OSError, match="model.safetensors|pytorch_model.bin"):
            AutoModelForCausalLM.from_pretrained(ckpt, **kwargs)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
    with pytest.raises(ValueError, match="index.json"):
        load_checkpoint_in_model(model, str(ckpt))


def test_a_version_2_checkpoint_loads_as_before(tmp_path):
    """The last version 2 elsa_ds wrote: verified, known as sparse, loaded in both modes; its weights compressed again
    (as version 3) load bit for bit the same."""
    v2 = shutil.copytree(V2, tmp_path / "v2")
    meta = json.loads((v2 / "config.json").read_text())["elsa_sparse"]
    assert meta["version"] == 2 and (v2 / "model.safetensors.index.json").is_file() and not list(v2.glob("elsa-sparse*"))
    assert set(verify(v2)) == {"plain", "bitmask", "delta8"} and verify(v2)["delta8"] > 0 and is_sparse_checkpoint(str(v2))
    dense = from_pretrained(v2)
    ids = torch.arange(12).reshape(2, 6) % dense.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(v2, mode="sparse")(input_ids=ids).logits, dense(input_ids=ids).logits)
    dense.save_pretrained(tmp_path / "dense")
    compress(tmp_path / "dense", tmp_path / "v3", max_shard_size="2KB")
    assert (tmp_path / "v3" / SPARSE_INDEX).is_file() and verify(tmp_path / "v3") == verify(v2)
    again, first = _state(from_pretrained(tmp_path / "v3")), _state(dense)
    assert again.keys() == first.keys() and all(torch.equal(t, first[k]) for k, t in again.items())


def _relabeled(ckpt: Path, version: int) -> Path:
    config = json.loads((ckpt / "config.json").read_text())
    config["elsa_sparse"]["version"] = version
    (ckpt / "config.json").write_text(json.dumps(seal(config)))
    return ckpt


def _v3_copied_over_v2(tiny_sparse_dir: Path, root: Path) -> Path:
    """cp -r v3/* over a folder that held version 2 (or an upload onto a hub repository that did): both layouts."""
    ckpt = as_model_named(shutil.copytree(tiny_sparse_dir, root / "ckpt"), version=2)
    for f in tiny_sparse_dir.iterdir():
        shutil.copy(f, ckpt / f.name)
    return ckpt


def _both_single_and_index(tiny_sparse_dir: Path, root: Path) -> Path:
    ckpt = shutil.copytree(tiny_sparse_dir, root / "ckpt")
    (ckpt / SPARSE_FILE).write_bytes(next(ckpt.glob(SPARSE_SHARDS)).read_bytes())
    return ckpt


def _index_names_another_file(tiny_sparse_dir: Path, root: Path) -> Path:
    ckpt = shutil.copytree(tiny_sparse_dir, root / "ckpt")
    index = json.loads((ckpt / SPARSE_INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (ckpt / first).rename(ckpt / "weights.safetensors")
    index["weight_map"] = {k: "weights.safetensors" if v == first else v for k, v in index["weight_map"].items()}
    (ckpt / SPARSE_INDEX).write_text(json.dumps(index))
    return ckpt


def _index_linked_outside(tiny_sparse_dir: Path, root: Path) -> Path:
    ckpt = shutil.copytree(tiny_sparse_dir, root / "ckpt")
    shutil.move(ckpt / SPARSE_INDEX, root / SPARSE_INDEX)
    (ckpt / SPARSE_INDEX).symlink_to(root / SPARSE_INDEX)
    return ckpt


def _config_linked_outside(tiny_sparse_dir: Path, root: Path) -> Path:
    ckpt = shutil.copytree(tiny_sparse_dir, root / "ckpt")
    shutil.move(ckpt / "config.json", root / "config.json")
    (ckpt / "config.json").symlink_to(root / "config.json")
    return ckpt


MIXED = {
    "v3_copied_over_v2": (_v3_copied_over_v2, r"model-00001-of-00006\.safetensors: a transformers weight file, which an "
                          "elsa-sparse checkpoint of format version 3 never holds"),
    "v2_relabeled_3": (lambda d, r: _relabeled(as_model_named(shutil.copytree(d, r / "ckpt"), 2), 3), "a transformers weight file"),
    "v3_relabeled_2": (lambda d, r: _relabeled(shutil.copytree(d, r / "ckpt"), 2), r"holds no model weights \(model.safetensors"),
    "single_and_index": (_both_single_and_index, f"holds both {SPARSE_INDEX} and {SPARSE_FILE}"),
    "index_names_another_file": (_index_names_another_file, "names 'weights.safetensors', which is no elsa-sparse shard's name"),
    "index_linked_outside": (_index_linked_outside, f"'{SPARSE_INDEX}' is a link to .*outside"),
    "config_linked_outside": (_config_linked_outside, "'config.json' is a link to .*outside"),
}


@pytest.mark.parametrize("case", sorted(MIXED))
def test_a_folder_that_mixes_layouts_or_leads_outside_is_refused_in_one_line(tiny_sparse_dir, tmp_path, case):
    make, message = MIXED[case]
    ckpt = make(tiny_sparse_dir, tmp_path)
    for load in (verify, from_pretrained, lambda p: from_pretrained(p, mode="sparse", verify=False)):
        with pytest.raises(SparseCheckpointError, match=message) as err:
            load(ckpt)
        assert "\n" not in str(err.value)
