"""An elsa-sparse checkpoint given where a model is expected: transformers finds none of its pruned weights under their
names (values and positions are stored) and builds them at random with a warning only, so the evaluation read 5019
where the dense export reads 69 (a user's walk through the README). The evaluation loads it through its own loader,
decompressed, and scores what the dense export scores; a pruning job refuses it as --model or --init_mask, one line."""
from __future__ import annotations

import json

import pytest
import torch

from elsa_ds.cli import main_evaluate, main_prune

EVAL = ["--ppl", "shakespeare", "--seqlen", "64", "--limit", "4", "--batch_size", "4"]


def test_the_evaluation_scores_a_sparse_checkpoint_as_the_dense_export_it_was_made_from(pruned_dir, sparse_dir, tmp_path):
    results = {}
    for name, model in (("dense", pruned_dir), ("sparse", sparse_dir)):
        out = tmp_path / f"{name}.json"
        assert main_evaluate(["--model", str(model), *EVAL, "--output", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    dense, sparse = results["dense"], results["sparse"]
    assert sparse["ppl"]["shakespeare"]["ppl"] == dense["ppl"]["shakespeare"]["ppl"]  # bit for bit: the same weights
    assert sparse["sparsity"]["overall"] == pytest.approx(dense["sparsity"]["overall"]) and dense["sparsity"]["overall"] > 0.5
    assert sparse["sparsity"]["layers"].keys() == dense["sparsity"]["layers"].keys()


@pytest.mark.parametrize("flag", ["--model", "--init_mask"])
def test_a_pruning_job_refuses_a_sparse_checkpoint_in_one_line(sparse_dir, tmp_path, capsys, flag):
    args = ["--deepspeed", "zero3_offload", "--output_dir", str(tmp_path / "out"), "--steps", "2"]
    args += ["--model", str(sparse_dir)] if flag == "--model" else ["--init_mask", str(sparse_dir)]
    assert main_prune(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("elsa_ds: error")]
    assert len(errors) == 1 and f"{flag} {sparse_dir} is an elsa-sparse checkpoint" in errors[0], errors
    assert "then save_pretrained makes one; copy the tokenizer files beside it" in errors[0]  # the way out, whole
    assert not (tmp_path / "out").exists()


def test_a_dense_folder_saved_from_a_sparse_checkpoint_is_dense(sparse_dir, tmp_path, capsys):
    """The refusal's way out (a review's find): from_pretrained(mode="dense") then save_pretrained. The block in
    config.json describes the sparse files, not the model, so the save is a plain dense folder: evaluated by
    transformers, accepted by a pruning job; a config that kept the block beside dense shards is not taken for sparse."""
    import shutil

    from elsa_ds.models import is_sparse_checkpoint
    from elsa_ds.sparse import from_pretrained

    dense = tmp_path / "dense"
    from_pretrained(sparse_dir, mode="dense").save_pretrained(dense)
    assert "elsa_sparse" not in json.loads((dense / "config.json").read_text())
    stale = tmp_path / "stale"  # a save from before the block was dropped
    shutil.copytree(dense, stale)
    config = json.loads((stale / "config.json").read_text())
    config["elsa_sparse"] = json.loads((sparse_dir / "config.json").read_text())["elsa_sparse"]
    (stale / "config.json").write_text(json.dumps(config))
    assert is_sparse_checkpoint(str(sparse_dir)) and not is_sparse_checkpoint(str(dense)) and not is_sparse_checkpoint(str(stale))
    from elsa_ds.data.blocks import check_local_tokenizer
    from elsa_ds.errors import ElsaError

    with pytest.raises(ElsaError, match="has no tokenizer .*: copy the tokenizer files of the folder it was saved from"):
        check_local_tokenizer(str(dense))  # an audit: the save holds no tokenizer, and the job refuses such a folder
    for file in sparse_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, dense)
    check_local_tokenizer(str(dense))  # the refusal's advice followed


def test_a_hub_id_whose_owner_is_also_a_folder_here(tmp_path, monkeypatch):
    """A name whose first part is a folder here is a path (a typo'd out/run1 is 'no such directory' at once, not ~30 s of
    hub retries), unless it is a hub id this machine knows: a shipped config (offline estimates) or one in the cache."""
    from elsa_ds.errors import ElsaError
    from elsa_ds.models import check_local_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "google").mkdir()
    check_local_path("google/gemma-2-27b")  # shipped in elsa_ds/model_configs
    with pytest.raises(ElsaError, match="no such directory .google/ is a folder here.*run from another folder"):
        check_local_path("google/no-such-model")


def test_a_decompressed_checkpoint_is_spread_as_device_map_auto_spreads_the_dense_export(sparse_dir, tmp_path, capsys):
    """The evaluation's --device_map auto (a pruning job's own end-of-run evaluation sets it on a GPU host) spreads a
    decompressed sparse checkpoint with accelerate as transformers spreads the dense export, where it used to load it
    whole onto one GPU. Here the GPUs' tier is absent: the CPU is given room for half the weights, the rest goes to the
    offload folder, and the logits are the unspread model's bit for bit."""
    from elsa_ds.jobs.evaluate import spread
    from elsa_ds.sparse import from_pretrained

    reference = from_pretrained(sparse_dir)
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    model = from_pretrained(sparse_dir)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    (tmp_path / "offload").mkdir()  # the evaluation's temporary folder
    spread_model = spread(model, str(tmp_path / "offload"), max_memory={"cpu": weights // 2})
    assert set(spread_model.hf_device_map.values()) == {"cpu", "disk"}, spread_model.hf_device_map
    assert "spreading the decompressed model over cpu, disk (device_map auto)" in capsys.readouterr().out
    assert any((tmp_path / "offload").iterdir())  # the disk tier holds weights
    with torch.no_grad():
        assert torch.equal(spread_model(input_ids=ids).logits, expected)
