"""Files a user can have, damaged, and settings that pass their bounds but not the run (issue 42): each named in one line
on stderr with exit code 2 (an ElsaError from the API) before any weight is loaded, never a traceback; settings that
leave part of the schedule unreachable are said, not run silently."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

import elsa_ds
from elsa_ds import cli
from elsa_ds.errors import ElsaError
from elsa_ds.settings.config import DEMO_MODEL_DIR
from tests.inprocess import demo_copy, one_line, run_main, stop_at_the_job  # noqa: F401 (a fixture)

FAST = ["--deepspeed", "zero3_offload", "--dataset", "shakespeare", "--seqlen", "64", "--steps", "8", "--val_windows", "0",
        "--baseline", "none"]


def _prune(model, out, *extra: str) -> tuple[int, str, str]:
    elsa = [] if "--method" in extra else ["--interval", "2"]
    return run_main(cli.main_prune, [*FAST, *elsa, "--model", str(model), "--output_dir", str(out), *extra])


def _evaluate(model, tmp_path, *extra: str) -> tuple[int, str, str]:
    return run_main(cli.main_evaluate, ["--model", str(model), "--ppl", "shakespeare", "--seqlen", "64", "--limit", "2",
                                        "--output", str(tmp_path / "result.json"), *extra])


def _estimate(model, *extra: str) -> tuple[int, str, str]:
    return run_main(cli.main_estimate, ["--model", str(model), "--deepspeed", "zero3_offload", "--seqlen", "64", *extra])


def _edit_json(path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


# ---- config.json ------------------------------------------------------------------------------------------------------
CONFIGS = {
    "a field of the wrong type": lambda p: _edit_json(p, lambda c: {**c, "hidden_size": "big"}),
    "a list where a number goes": lambda p: _edit_json(p, lambda c: {**c, "num_hidden_layers": [4]}),
    "not JSON": lambda p: p.write_text('{"architectures": ['),
    "not an object": lambda p: p.write_text("[1, 2, 3]"),
    "no attention heads": lambda p: _edit_json(p, lambda c: {**c, "num_attention_heads": 0}),  # a ZeroDivisionError inside
}


@pytest.mark.parametrize("damage", list(CONFIGS))
def test_a_damaged_config_json_is_one_line_for_prune_estimate_and_evaluate(damage, tmp_path, stop_at_the_job):
    model = demo_copy(tmp_path / "model")
    CONFIGS[damage](model / "config.json")
    one_line(*_prune(model, tmp_path / "o")[:2], "config.json")
    one_line(*_estimate(model)[:2], "config.json")
    one_line(*_evaluate(model, tmp_path)[:2], "config.json")
    assert not (tmp_path / "o").exists() and not (tmp_path / "result.json").exists()


def test_a_damaged_config_json_is_an_elsa_error_from_the_api(tmp_path, stop_at_the_job):
    model = demo_copy(tmp_path / "model")
    CONFIGS["a field of the wrong type"](model / "config.json")
    with pytest.raises(ElsaError, match="hidden_size"):
        elsa_ds.prune(str(model), "shakespeare", output_dir=tmp_path / "o", seqlen=64, steps=4)
    assert not (tmp_path / "o").exists()


def test_a_model_that_needs_remote_code_is_refused_without_a_prompt(tmp_path, stop_at_the_job):
    model = demo_copy(tmp_path / "model")
    _edit_json(model / "config.json", lambda c: {**c, "model_type": "my_own_llm",
                                                 "auto_map": {"AutoConfig": "configuration_mine.MyConfig",
                                                              "AutoModelForCausalLM": "modeling_mine.MyModel"}})
    for code, err, out in (_estimate(model), _prune(model, tmp_path / "o"), _evaluate(model, tmp_path)):
        one_line(code, err, "config.json", "its own Python code")
        assert "Do you wish to run" not in out + err


def test_a_config_json_of_another_model_than_its_weights_is_named_before_loading(tmp_path, stop_at_the_job):
    model = demo_copy(tmp_path / "model")
    _edit_json(model / "config.json", lambda c: {**c, "hidden_size": 320})
    needles = ("config.json does not describe its weights", "model.embed_tokens.weight [4096, 256]", "[4096, 320]")
    one_line(*_prune(model, tmp_path / "o")[:2], *needles)
    code, err, out = _evaluate(model, tmp_path)
    one_line(code, err, *needles)
    assert "loaded" not in out + err
    _edit_json(model / "config.json", lambda c: {**c, "hidden_size": 256, "architectures": "Gemma2ForCausalLM"})
    one_line(*_prune(model, tmp_path / "o")[:2], "architectures in its config.json", "not a list")


# ---- tokenizer.json ---------------------------------------------------------------------------------------------------
TOKENIZERS = {
    "no model": lambda p: _edit_json(p, lambda t: {k: v for k, v in t.items() if k != "model"}),
    "a list": lambda p: p.write_text("[1, 2]"),
    "an empty object": lambda p: p.write_text("{}"),
    "added_tokens a string": lambda p: _edit_json(p, lambda t: {**t, "added_tokens": "x"}),
    "vocab a list": lambda p: _edit_json(p, lambda t: {**t, "model": {**t["model"], "vocab": [1, 2]}}),
    # a walk (2026-12-02): the Rust regex engine panics (a BaseException) on it: a traceback on every rank
    "a backtracking pre-tokenizer": lambda p: _edit_json(p, lambda t: {**t, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(.|.)*\\d"}, "behavior": "Isolated", "invert": False}, t["pre_tokenizer"]]}}),
}


@pytest.mark.parametrize("damage", list(TOKENIZERS))
def test_a_tokenizer_json_of_the_wrong_structure_is_one_line_before_the_model_loads(damage, tmp_path, stop_at_the_job):
    model = demo_copy(tmp_path / "model")
    TOKENIZERS[damage](model / "tokenizer.json")
    one_line(*_prune(model, tmp_path / "o")[:2], "tokenizer.json")
    code, err, out = _evaluate(model, tmp_path)
    one_line(code, err, "tokenizer.json")
    assert "loaded" not in out + err and not (tmp_path / "o").exists()


def test_a_tokenizer_with_ids_beyond_the_models_vocabulary_is_named_by_evaluate(tmp_path):
    model = demo_copy(tmp_path / "model")
    _edit_json(model / "tokenizer.json", lambda t: {**t, "model": {**t["model"], "vocab": {
        token: i + 5000 if 300 <= i < 800 else i for token, i in t["model"]["vocab"].items()}}})
    one_line(*_evaluate(model, tmp_path)[:2], "--ppl shakespeare", "beyond the vocab_size 4096")
    assert not (tmp_path / "result.json").exists()


# ---- model.safetensors ------------------------------------------------------------------------------------------------
def test_a_truncated_init_mask_folder_is_named_before_loading(tmp_path, stop_at_the_job):
    pruned = demo_copy(tmp_path / "pruned")
    weights = pruned / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", "--init_mask", str(pruned))[:2], "--init_mask", "model.safetensors")
    with pytest.raises(ElsaError, match="model.safetensors"):
        elsa_ds.prune(str(DEMO_MODEL_DIR), "shakespeare", output_dir=tmp_path / "o", seqlen=64, steps=4, init_mask=str(pruned))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("damage", ["truncated", "unknown dtype"])
def test_a_damaged_model_safetensors_is_named_by_evaluate_before_loading(damage, tmp_path):
    model = demo_copy(tmp_path / "model")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000] if damage == "truncated" else data.replace(b'"F32"', b'"F33"', 1))
    code, err, out = _evaluate(model, tmp_path)
    one_line(code, err, "model.safetensors")
    assert "loaded" not in out + err and not (tmp_path / "result.json").exists()


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_shard_index_naming_weights_outside_the_model_folder_is_refused(where, tmp_path, stop_at_the_job):
    """transformers joins an index's file names onto the folder as given: '..' or an absolute name would have it read
    weights from anywhere on disk. Refused in one line by prune and evaluate, before anything loads; a folder whose
    index names its own shards loads as before (the estimate reads it)."""
    from elsa_ds.files.weight_files import check_weight_files

    model, elsewhere = demo_copy(tmp_path / "model"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    (model / "model.safetensors").rename(elsewhere / "model-00001-of-00001.safetensors")
    names = json.loads((DEMO_MODEL_DIR / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (DEMO_MODEL_DIR / "model.safetensors").read_bytes()[:8], "little")])
    shard = "../elsewhere/model-00001-of-00001.safetensors" if where == "relative" else str(elsewhere / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {name: shard for name in names if name != "__metadata__"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line(*_prune(model, tmp_path / "o")[:2], "model.safetensors.index.json", repr(shard), "must lie inside")
    assert not (tmp_path / "o").exists()
    code, err, out = _evaluate(model, tmp_path)
    one_line(code, err, "model.safetensors.index.json", "must lie inside")
    assert "loaded" not in out + err and not (tmp_path / "result.json").exists()
    (elsewhere / "model-00001-of-00001.safetensors").rename(model / "model-00001-of-00001.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": {
        name: "model-00001-of-00001.safetensors" for name in index["weight_map"]}}))
    check_weight_files(model, f"model {model}")  # its own shard: nothing to refuse
    assert _estimate(model)[0] == 0


@pytest.mark.parametrize("linked", ["model.safetensors", "config.json"])
def test_a_model_folders_file_linked_outside_it_is_refused_and_the_hub_caches_layout_is_not(linked, tmp_path, stop_at_the_job):
    """A folder handed over is data: a link among its own files that leads outside it is refused in one line before
    anything loads (prune, with --random_init too, evaluate and the estimate); the hub cache's snapshot, whose files link
    into the repository's blobs/, loads."""
    model, elsewhere = demo_copy(tmp_path / "model"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    (model / linked).rename(elsewhere / linked)
    (model / linked).symlink_to(elsewhere / linked)
    one_line(*_prune(model, tmp_path / "o")[:2], repr(linked), "outside", "cp -L")
    one_line(*_prune(model, tmp_path / "o", "--random_init")[:2], repr(linked), "outside")  # its tokenizer and config read
    one_line(*_estimate(model)[:2], repr(linked), "outside")
    assert not (tmp_path / "o").exists()
    code, err, out = _evaluate(model, tmp_path)
    one_line(code, err, repr(linked), "outside")
    assert "loaded" not in out + err and not (tmp_path / "result.json").exists()
    repo = tmp_path / "hub" / "models--org--demo"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in sorted(DEMO_MODEL_DIR.iterdir()):
        if file.is_file():
            shutil.copy2(file, blobs / file.name)
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", file.name))
    assert _estimate(snapshot)[0] == 0


def _hub_cache(hub: Path, repo_id: str) -> tuple[Path, Path]:
    """The demo model as the Hugging Face cache holds a download of ``repo_id``: refs/main naming a snapshot whose files
    link into the repository's blobs/; (snapshot, blobs)."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    for file in sorted(DEMO_MODEL_DIR.iterdir()):
        if file.is_file():
            shutil.copy2(file, blobs / file.name)
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", file.name))
    return snapshot, blobs


def test_a_hub_id_this_machine_has_cached_is_checked_as_a_folder_is(tmp_path, monkeypatch, stop_at_the_job):
    """A walk (2026-12-04): a model named by hub id reached transformers unchecked, its cached files too (a truncated
    shard, a .bin pickle bomb: what a folder given by path is refused for in one line). The cache's snapshot is now
    checked as that folder: a damaged shard is one line before anything loads, with the command that fetches it again; a
    whole one reaches the job; a shard the index names and the cache lacks yet is transformers' to download, or one line
    where the hub cannot be asked."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot, blobs = _hub_cache(tmp_path / "hub", "org/demo")
    assert _prune("org/demo", tmp_path / "o")[0] == 0  # whole: the job starts
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (blobs / "index").write_text(json.dumps(index))
    (snapshot / "model.safetensors.index.json").symlink_to(Path("..", "..", "blobs", "index"))
    # a shard not downloaded yet: offline, one line now (transformers failed at the load, after the checks and the warm
    # start); where the hub answers, transformers fetches it
    one_line(*_prune("org/demo", tmp_path / "o2")[:2], "model org/demo", "lacks model-00002-of-00002.safetensors",
             "HF_HUB_OFFLINE", "hf download org/demo")
    monkeypatch.setattr("elsa_ds.data.hub_texts.hub_unreachable", lambda: None)
    assert _prune("org/demo", tmp_path / "o2")[0] == 0
    whole = (blobs / "model.safetensors").read_bytes()
    (blobs / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    one_line(*_prune("org/demo", tmp_path / "o3")[:2], "model org/demo", "model.safetensors", "damaged",
             f"cache's copy ({snapshot})", "hf download org/demo model.safetensors --force-download")
    assert not (tmp_path / "o3").exists()


# ---- values that pass their bounds but not the run ----------------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--lmda", "inf"], ["--weight_decay", "inf"], ["--lr", "inf"], ["--eps", "inf"],
                                   ["--lora_alpha", "inf", "--method", "wanda", "--finetune", "lora"], ["--percdamp", "inf"]])
def test_a_non_finite_float_setting_is_refused_up_front(flags, tmp_path, stop_at_the_job):
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", *flags)[:2], flags[0].removeprefix("--"), "finite")
    assert not (tmp_path / "o").exists()


def test_a_non_finite_float_in_a_recipe_or_from_the_api_is_refused(tmp_path, stop_at_the_job):
    recipe = tmp_path / "r.json"
    recipe.write_text('{"source": "a test", "settings": {"lmda": Infinity}}')
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", "--recipe", str(recipe))[:2], "recipe", "lmda", "finite")
    with pytest.raises(ElsaError, match="lr=inf"):
        elsa_ds.prune(str(DEMO_MODEL_DIR), "shakespeare", output_dir=tmp_path / "o", lr=float("inf"))


BIG = "9" * 400  # past ~1.8e308: no float holds it


@pytest.mark.parametrize("flags,needle", [(["--steps", BIG], "at most 9,007,199,254,740,992"),
                                          (["--nsamples", BIG], "at most 9,007,199,254,740,992"),
                                          (["--val_windows", BIG], "at most 9,007,199,254,740,992"),
                                          (["--seed", str(2**64)], "[0, 4294967295]"), (["--seed", "-1"], "[0, 4294967295]")],
                         ids=["steps", "nsamples", "val_windows", "seed 2**64", "seed -1"])
def test_a_whole_number_past_what_the_run_computes_with_is_refused_up_front(flags, needle, tmp_path, stop_at_the_job):
    """An audit (2026-12-06): a 400-digit --steps, --nsamples or --val_windows ended the step-time or memory estimate in an
    OverflowError traceback; --seed 2**64 was torch.manual_seed's ValueError after the SparseGPT warm start."""
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", *flags)[:2], f"{flags[0].removeprefix('--')}=", needle)
    if flags[0] != "--seed":  # the estimate reads no seed
        one_line(*_estimate(DEMO_MODEL_DIR, *flags)[:2], needle)
    recipe = tmp_path / "r.json"
    recipe.write_text(f'{{"source": "a test", "settings": {{"{flags[0].removeprefix("--")}": {flags[1]}}}}}')
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", "--recipe", str(recipe))[:2], "recipe", needle)
    assert not (tmp_path / "o").exists()


def test_a_long_refused_value_is_quoted_cut(tmp_path, stop_at_the_job):
    """An audit: a refusal quoted a 400- or 10,000-digit value whole (one line, but of 10,000 characters)."""
    for digits, where in ((400, "steps="), (10_000, "argument --steps: invalid int value")):
        code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--steps", "9" * digits)[:3]
        one_line(code, err, where, "9" * 60 + "...", "characters)")
        assert len(err) < 1000, err


# ---- a schedule the run cannot reach ------------------------------------------------------------------------------------
def test_a_warm_up_as_long_as_the_run_is_refused(tmp_path, stop_at_the_job):
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", "--warmup_steps", "8", "--lr", "1e-3")[:2], "warmup_steps", "steps")
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", "--warmup_steps", "20", "--lr", "1e-3")[:2], "warmup_steps")
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", "--method", "wanda", "--finetune", "full", "--finetune_steps", "4",
                     "--warmup_steps", "4", "--lr", "1e-3")[:2], "warmup_steps")
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--warmup_steps", "7", "--lr", "1e-3")
    assert code == 0, err


def _warnings(err: str) -> list[str]:
    """The job's warnings but the machine's own (a CPU without a fast bf16 matmul runs fp32: true of some CI machines)."""
    return [line for line in err.splitlines() if line.startswith("elsa_ds: warning") and "fast bf16 matmul" not in line]


def test_parts_of_the_schedule_the_run_never_reaches_are_warned_about(tmp_path, stop_at_the_job):
    args = ["--lr", "1e-3", "--init_mask", "none", "--sparsity", "0.5"]
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", *args, "--interval", "16")  # 8 steps, one projection every 16
    assert code == 0 and any("interval 16" in w and "never" in w for w in _warnings(err)), err
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", *args, "--select_every", "4", "--val_windows", "2")  # 3 projections
    assert code == 0 and any("select_every 4" in w and "3 projections" in w for w in _warnings(err)), err
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", *args, "--save_interval", "8")
    assert code == 0 and any("save_interval 8" in w and "no checkpoint" in w for w in _warnings(err)), err
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", *args)  # a schedule the run reaches: no word
    assert code == 0 and not _warnings(err), err


def test_the_schedule_is_checked_with_the_values_the_defaults_rule_resolved(tmp_path, stop_at_the_job):
    """At 90 % over 100 steps the rule starts pruned and holds the last 50 steps: an interval of 128 then leaves the
    ADMM part with no projection, which only the resolved hold_steps shows; at 64 the rule holds 35 (the ADMM part's one
    update at step 63 left before it), and no word."""
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--sparsity", "0.9", "--steps", "100", "--interval", "128")
    assert code == 0 and any("interval 128" in w and "hold_steps" in w for w in _warnings(err)), err
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--sparsity", "0.9", "--steps", "100", "--interval", "64")
    assert code == 0 and not _warnings(err), err
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--sparsity", "0.9", "--steps", "100", "--interval", "8")
    assert code == 0 and not _warnings(err), err
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--sparsity", "0.5", "--steps", "1", "--interval", "1")
    assert code == 0, err  # the rule's warm-up of one step in a one-step run is no warm-up at all: not refused


# ---- seqlen beyond the model's positions ---------------------------------------------------------------------------------
def test_a_seqlen_beyond_the_models_positions_is_refused_before_loading(tmp_path, stop_at_the_job):
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", "--seqlen", "1024")[:2], "--seqlen 1024", "max_position_embeddings 512")
    one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", "--seqlen", "1024", "--method", "magnitude")[:2], "max_position_embeddings")
    one_line(*_estimate(DEMO_MODEL_DIR, "--seqlen", "1024")[:2], "max_position_embeddings 512")
    assert not (tmp_path / "o").exists()
    assert _prune(DEMO_MODEL_DIR, tmp_path / "o", "--seqlen", "512")[0] == 0


# ---- launch/ablate_offload.py ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_ablation_refuses_a_non_positive_rank_count(value, tmp_path):
    spec = importlib.util.spec_from_file_location("ablate_offload", cli.__file__.replace("elsa_ds/cli.py", "launch/ablate_offload.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code, err, _ = run_main(module.main, ["--configs", "zero3_offload", "--out", str(tmp_path / "a"), "--num_gpus", value])
    one_line(code, err, "--num_gpus")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("section", [{"zero_optimization": []}, {"bf16": True}, {"elsa": "x"},
                                     {"zero_optimization": {"stage": 3, "offload_param": "cpu"}}])
def test_a_deepspeed_json_section_of_the_wrong_type_is_named(tmp_path, section):
    """Seed 4242 of the file fuzz found ``"offload_param": "cpu"`` reaching an AttributeError in the estimator."""
    from elsa_ds.errors import ElsaError
    from elsa_ds.zero.ds_config import DsConfig

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **section}))
    with pytest.raises(ElsaError, match=r"must be a JSON object") as err:
        DsConfig.load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


WRONG_TYPES = [("zero_optimization.offload_optimizer.ratio", "half", "a number"), ("optimizer.params", [1], "an object"),
               ("scheduler.params", "x", "an object"), ("zero_optimization.offload_optimizer.buffer_count", "many", "a whole number"),
               ("zero_optimization.offload_param.nvme_path", 5, "a string"), ("zero_optimization.offload_param.device", ["nvme"], "a string"),
               ("bf16.enabled", 1, "true or false"), ("zero_optimization.offload_param.buffer_size", True, "a whole number (5e8 is one)")]


@pytest.mark.parametrize("key,value,kind", WRONG_TYPES, ids=[k for k, _, _ in WRONG_TYPES])
def test_a_value_elsa_ds_reads_of_another_type_is_named_before_the_model_loads(tmp_path, key, value, kind):
    """A second audit: a ratio of "half", a list of params or a buffer_count of "many" ended the check in a traceback; a
    device of ["nvme"] or an nvme_path of 5 passed it, for DeepSpeed to refuse after the model was built."""
    raw = json.loads((Path(elsa_ds.__file__).parent.parent / "ds_configs" / "zero3_offload.json").read_text())
    *sections, last = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--deepspeed", str(path))
    one_line(code, err, f'"{key}" must be {kind}, not {json.dumps(value)}', str(path))
    assert not (tmp_path / "o").exists()


OUT_OF_RANGE = [("zero_optimization.reduce_bucket_size", "big", "must be a whole number (5e8 is one), not \"big\""),
                ("zero_optimization.reduce_bucket_size", 1.5, "must be a whole number (5e8 is one) in [1, "),
                ("zero_optimization.sub_group_size", int(BIG), "must be a whole number (5e8 is one) in [0, 9,007,199,254,740,992]"),
                ("zero_optimization.offload_optimizer.ratio", int(BIG), "must be a number in [0, 1]"),
                ("zero_optimization.offload_param.buffer_size", int(BIG), "must be a whole number (5e8 is one) in [0, "),
                ("zero_optimization.stage3_max_live_parameters", float("inf"), "not Infinity"),
                ("gradient_clipping", float("nan"), "must be a number of at least 0, finite, not NaN"),
                ("gradient_clipping", "one", "must be a number, not \"one\""),
                ("checkpoint.tag_validation", "Nonsense", "must be one of WARN, IGNORE, FAIL"),
                ("checkpoint.tag_validation", None, "must be one of WARN, IGNORE, FAIL (any case), not null"),
                ("flops_profiler.output_file", "/tmp", "'/tmp' is a folder")]


@pytest.mark.parametrize("key,value,needle", OUT_OF_RANGE, ids=[f"{k}={v}"[:60] for k, v, _ in OUT_OF_RANGE])
def test_a_deepspeed_value_out_of_its_range_or_one_deepspeed_reads_late_is_named_up_front(tmp_path, key, value, needle,
                                                                                           stop_at_the_job):
    """An audit (2026-12-06): a reduce_bucket_size of "big", a 400-digit sub_group_size, ratio or buffer_size ended the
    estimate (and the job's pre-flight) in a ValueError or OverflowError traceback; a gradient_clipping of "one", a
    checkpoint.tag_validation of "Nonsense" and an enabled flops profiler's output_file naming a folder failed in
    DeepSpeed after the model load and the warm start (a NaN clip would silently never clip)."""
    raw = json.loads((Path(elsa_ds.__file__).parent.parent / "ds_configs" / "zero3_offload.json").read_text())
    *sections, last = key.split(".")
    node = raw
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
    if key.startswith("flops_profiler"):
        node["enabled"] = True
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--deepspeed", str(path))
    one_line(code, err, f'"{key}"', needle, str(path))
    one_line(*run_main(cli.main_estimate, ["--model", str(DEMO_MODEL_DIR), "--deepspeed", str(path)])[:2], f'"{key}"', needle)
    assert not (tmp_path / "o").exists()


def _within(seconds: int, what: str) -> None:
    """A hang fails the test (SIGALRM) instead of the suite."""
    import signal

    signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"{what} waited on a FIFO"))
    signal.alarm(seconds)


def test_a_fifo_among_a_sparse_marked_model_folders_weights_is_refused_not_waited_on(tmp_path, stop_at_the_job):
    """An audit (2026-12-06): a config.json with an "elsa_sparse" block and a FIFO named zz.safetensors: the
    sparse-checkpoint check opened the FIFO and waited for good, the output's lock held."""
    import os
    import signal

    model = demo_copy(tmp_path / "model")
    _edit_json(model / "config.json", lambda c: {**c, "elsa_sparse": {}})
    os.mkfifo(model / "zz.safetensors")
    _within(60, "the model folder's check")
    try:
        one_line(*_prune(model, tmp_path / "o")[:2], "zz.safetensors is not a regular file")
    finally:
        signal.alarm(0)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("given", ["recipe", "command line"])
def test_a_sparsity_profile_that_is_a_fifo_is_refused_not_waited_on(given, tmp_path, stop_at_the_job):
    """An audit (2026-12-06): a recipe naming "sparsity_profile": "p.json" beside it, a FIFO there, waited for a writer for
    good; the same reader refuses one given on the command line too."""
    import os
    import signal

    (tmp_path / "r").mkdir()
    os.mkfifo(tmp_path / "r" / "p.json")
    (tmp_path / "r" / "recipe.json").write_text(json.dumps({"source": "x", "settings": {"sparsity_profile": "p.json"}}))
    flags = ["--recipe", str(tmp_path / "r" / "recipe.json")] if given == "recipe" else ["--sparsity_profile",
                                                                                          str(tmp_path / "r" / "p.json")]
    _within(60, "the sparsity profile's reader")
    try:
        one_line(*_prune(DEMO_MODEL_DIR, tmp_path / "o", *flags)[:2], "sparsity_profile", "p.json", "not a regular file")
    finally:
        signal.alarm(0)
    assert not (tmp_path / "o").exists()


LONG = "x" * 300  # one name longer than a file system's 255 bytes
NO_PATH = [(LONG, "a name in it is 300 bytes"), ("~nosuchuser9/x", "no user '~nosuchuser9'")]


@pytest.mark.parametrize("value,needle", NO_PATH, ids=["too long", "unknown user"])
@pytest.mark.parametrize("where", ["--output_dir", "--dataset", "--model", "--recipe", "--deepspeed", "--eval_ppl",
                                   "evaluate --model", "evaluate --output", "compress INPUT", "estimate --dataset"])
def test_a_text_no_path_can_be_is_named_by_every_entry_point(where, value, needle, tmp_path, stop_at_the_job):
    """A third audit: a value no path can be (too long for the file system, a ~user this machine lacks) ended in an
    OSError or RuntimeError traceback wherever a check asked the file system about it."""
    entry, flag = where.split() if " " in where else ("prune", where)
    if entry == "prune":
        given = {"--output_dir": str(tmp_path / "o"), flag: value}
        code, err, _ = run_main(cli.main_prune, [*FAST, *(x for pair in given.items() for x in pair)] if flag != "--deepspeed"
                                else [*FAST[2:], "--deepspeed", value, "--output_dir", str(tmp_path / "o")])
    elif entry == "evaluate":
        code, err, _ = run_main(cli.main_evaluate, ["--model", str(DEMO_MODEL_DIR), "--ppl", "shakespeare",
                                                    "--output", str(tmp_path / "r.json"), flag, value])
    elif entry == "estimate":
        code, err, _ = _estimate(DEMO_MODEL_DIR, flag, value)
    else:
        from elsa_ds.sparse.cli import main as compress
        code, err, _ = run_main(compress, [value, str(tmp_path / "c")])
    one_line(code, err, needle)
    assert not any(tmp_path.iterdir())


def test_a_model_folder_whose_path_is_not_utf8_is_named_as_such(tmp_path):
    """A seventh audit: its weights were reported damaged ("model.safetensors is damaged (Path ... is not valid UTF-8);
    copy or download it again"), which no copy mends: safetensors and the tokenizer open no file under such a path."""
    model = demo_copy(Path(os.fsdecode(bytes(tmp_path / "model_") + b"\xff")))
    for code, err, _ in (_prune(model, tmp_path / "o", "--method", "magnitude"), _evaluate(model, tmp_path)):
        assert "damaged" not in one_line(code, err, ": its path is not valid UTF-8")
    (link := tmp_path / "link").symlink_to(model)  # a review: the path the readers get is UTF-8, and they read it
    assert _evaluate(link, tmp_path)[0] == 0


def test_a_files_longest_path_leaves_room_for_the_nul_that_ends_it(tmp_path):
    """A review: Linux's 4,096 bytes count the NUL that ends a path, so a path of 4,083 bytes left an evaluation's
    temporary name (13 more with a 7-digit PID) one byte too long, the result lost after the work."""
    from elsa_ds.files.io import ATOMIC_ROOM
    from elsa_ds.files.ownership import PATH_MAX, check_output_names

    def path_of(size: int) -> str:
        path = os.path.abspath(tmp_path)
        while size - len(path) - 1 > 201:
            path = os.path.join(path, "p" * 200)
        return os.path.join(path, "r" * (size - len(path) - 1))  # a name of 1-201 bytes

    assert len(os.fsencode(path_of(PATH_MAX - ATOMIC_ROOM - 1))) == PATH_MAX - ATOMIC_ROOM - 1
    check_output_names(path_of(PATH_MAX - ATOMIC_ROOM - 1), "--output", beside=ATOMIC_ROOM, inside=0)
    with pytest.raises(ElsaError, match="too little of a path's 4,096"):
        check_output_names(path_of(PATH_MAX - ATOMIC_ROOM), "--output", beside=ATOMIC_ROOM, inside=0)


@pytest.mark.parametrize("entry", ["prune", "evaluate", "compress"])
def test_an_output_the_job_could_only_fail_to_publish_is_refused_before_work(entry, tmp_path, monkeypatch):
    """A seventh audit: names that pass every check but not the job's own side names ended after the work, the result
    lost: a name of 222 bytes (its staging folder ``.NAME.partial.PID`` past 255: a traceback), a path near 4,096 bytes
    (its report's temporary file: a traceback at the publication), ``nosuch/../o`` (resolved on paper, the final rename
    failed); a name that is not UTF-8 (the tokenizer's files cannot be written under it: prune's traceback). An
    evaluation's files keep only their temporary name beside them: names of 208-242 bytes were refused there."""
    from elsa_ds.files.io import ATOMIC_ROOM
    from elsa_ds.files.ownership import NAME_MAX, PATH_MAX, SIDE_ROOM
    from elsa_ds.sparse.cli import main as compress
    from tests.sparse.conftest import pruned_demo

    (afile := tmp_path / "afile").write_text("")
    deep = tmp_path.joinpath(*["p" * 200] * 19)
    deep.mkdir(parents=True)
    longest = NAME_MAX - (ATOMIC_ROOM if entry == "evaluate" else SIDE_ROOM)
    far = deep / "out"
    if entry == "evaluate":  # a file's path 5 bytes short of the limit: its temporary name's is past it
        far = deep / ("q" * (PATH_MAX - 6 - len(os.fsencode(deep))))
    cases = [(tmp_path / ("c" * (longest + 1)), f"its name is {longest + 1} bytes"), (far, "too little of a path's 4,096"),
             (tmp_path / "nosuch" / ".." / "o", "nosuch"), (afile / ".." / "o", "afile")]
    if entry == "prune":
        cases.append((Path(os.fsdecode(bytes(tmp_path / "out_") + b"\xff")), "not valid UTF-8"))
    for out, needle in cases:
        if entry == "prune":
            code, err, _ = _prune(DEMO_MODEL_DIR, out, "--method", "magnitude")
        elif entry == "evaluate":
            code, err, _ = _evaluate(DEMO_MODEL_DIR, tmp_path, "--output", str(out))
        else:
            source = tmp_path / "in" if (tmp_path / "in").exists() else pruned_demo(tmp_path / "in")
            code, err, _ = run_main(compress, [str(source), str(out)])
        one_line(code, err, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", *(["in"] if entry == "compress" else []), "p" * 200]
    if entry == "evaluate":  # the longest name allowed is written whole
        code, err, _ = _evaluate(DEMO_MODEL_DIR, tmp_path, "--output", str(out := tmp_path / ("e" * longest)))
        assert code == 0 and json.loads(out.read_text()), err[-2000:]
    if entry == "prune":  # a review: the real path is what must be UTF-8, and the longest name allowed publishes whole
        odd = tmp_path / os.fsdecode(b"dir_\xff")
        odd.mkdir()
        monkeypatch.chdir(odd)
        one_line(*_prune(DEMO_MODEL_DIR, Path("out"), "--method", "magnitude")[:2], "not valid UTF-8")
        out = tmp_path / ("n" * (NAME_MAX - SIDE_ROOM))
        code, err, _ = _prune(DEMO_MODEL_DIR, out, "--method", "magnitude", "--export_format", "sparse")
        assert code == 0 and (out / "elsa_report.json").is_file(), err[-2000:]


@pytest.mark.parametrize("value,needle", [*NO_PATH, ("a\0b.txt", "NUL byte")], ids=["too long", "unknown user", "nul"])
@pytest.mark.parametrize("source", ["recipe", "DeepSpeed JSON"])
def test_a_text_no_path_can_be_in_a_file_is_named(source, value, needle, tmp_path, stop_at_the_job):
    """The same values from a recipe (read against its folder) or the DeepSpeed JSON's "elsa" block (a NUL byte too,
    which no command line can hold)."""
    if source == "recipe":
        recipe = tmp_path / "r.json"
        recipe.write_text(json.dumps({"source": "test", "settings": {"val_dataset": value}}))
        code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--recipe", str(recipe))
    else:
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps({**json.loads((Path(cli.__file__).parents[1] / "ds_configs" / "zero3_offload.json")
                                               .read_text()), "elsa": {"val_dataset": value}}))
        code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--deepspeed", str(ds))
    assert needle in one_line(code, err, "val_dataset")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("source", ["recipe", "DeepSpeed JSON"])
def test_a_files_boolean_is_taken_only_where_a_setting_is_one(source, tmp_path, stop_at_the_job):
    """pydantic read JSON's true as the number 1 and "false" as False: ``"steps": true`` in a recipe ran one step. The
    value is quoted as the file spells it."""
    for key, value, needle in (("steps", True, "steps=true: a boolean, where a number is taken"),
                               ("freeze_embeddings", "false", 'freeze_embeddings="false": must be true or false'),
                               ("lr", "1e-3", 'lr="1e-3": text, where a number is taken')):
        if source == "recipe":
            (recipe := tmp_path / "r.json").write_text(json.dumps({"source": "test", "settings": {key: value}}))
            code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--recipe", str(recipe))
        else:
            ds = tmp_path / "ds.json"
            ds.write_text(json.dumps({**json.loads((Path(cli.__file__).parents[1] / "ds_configs" / "zero3_offload.json")
                                                   .read_text()), "elsa": {key: value}}))
            code, err, _ = _prune(DEMO_MODEL_DIR, tmp_path / "o", "--deepspeed", str(ds))
        one_line(code, err, needle)
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value,needle", [*NO_PATH, ("a\0b", "NUL byte"), ("~a\nb", "no user '~a\\nb'")],
                         ids=["too long", "unknown user", "nul", "newline"])
def test_a_model_no_path_can_be_from_the_json_or_the_api_is_named(value, needle, tmp_path, stop_at_the_job):
    """The review of the audit's fix: the JSON's "elsa" model and the API's were resolved (the demo's profile) before any
    check, a traceback still; the refusal stays one line with a newline in the value."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**json.loads((Path(cli.__file__).parents[1] / "ds_configs" / "zero3_offload.json").read_text()),
                              "elsa": {"model": value}}))
    code, err, _ = run_main(cli.main_prune, [*FAST[2:], "--deepspeed", str(ds), "--output_dir", str(tmp_path / "o")])
    assert needle in one_line(code, err, "model")
    with pytest.raises(ElsaError, match="model"):
        elsa_ds.prune(value, "shakespeare", output_dir=str(tmp_path / "o"), steps=2)
    with pytest.raises(ElsaError, match="output_dir"):
        elsa_ds.prune(str(DEMO_MODEL_DIR), "shakespeare", output_dir=value, steps=2)
    assert not (tmp_path / "o").exists()


def test_a_sources_own_bad_values_are_named_though_the_command_line_sets_them_over():
    """A path no path can be beside another bad value in the JSON's "elsa" block: both the block's own, named as such,
    though the command line gives both (the rule `check_each_source` keeps)."""
    from elsa_ds.settings.config import resolve_config

    with pytest.raises(ElsaError, match=r'"elsa" block.*dataset=.*no user.*steps=.four.'):
        resolve_config({"elsa": {"dataset": "~nosuchuser9/x", "steps": "four"}}, {"dataset": "shakespeare", "steps": 4})
    # only a list setting is split at its commas: "texts,~nosuchuser9" is one relative path for --dataset
    assert resolve_config({}, {"dataset": "texts,~nosuchuser9", "steps": 4}).dataset == "texts,~nosuchuser9"
    with pytest.raises(ElsaError, match="eval_ppl=.*no user"):
        resolve_config({}, {"eval_ppl": "wikitext2,~nosuchuser9/x", "steps": 4})


def test_a_path_given_with_a_tilde_is_the_home_folders_for_every_reader(tmp_path, monkeypatch, stop_at_the_job):
    """A user's walk (2026-12-04): ``--output_dir=~/x`` (no shell expands it there) made ``./~/x`` in the working folder,
    where ``--resume_if_any`` never looked; ``--model '~/m'`` reached transformers unexpanded (a "repo id" error) in
    elsa-prune and elsa-evaluate. Each path setting's ``~`` is now the home folder's, once, for every reader. And the
    README's ``--output results/s70.json`` was refused on a clean clone: --output's folders are made, as --output_dir's."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    demo_copy(home / "m")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    code, err, _ = _prune("~/m", "~/out")
    assert code == 0, err[-2000:]
    code, err, _ = run_main(cli.main_evaluate, ["--model", "~/m", "--ppl", "shakespeare", "--seqlen", "64", "--limit", "2",
                                               "--output", "~/results/r.json", "--markdown", "results/r.md"])
    assert code == 0, err[-2000:]
    assert (home / "results" / "r.json").is_file() and (work / "results" / "r.md").is_file() and not (work / "~").exists()
    import elsa_ds.jobs.evaluate as evaluate_job

    def fails(settings):
        raise ElsaError("the evaluation failed")

    monkeypatch.setattr(evaluate_job, "run", fails)  # a failed evaluation leaves no folder it made
    one_line(*run_main(cli.main_evaluate, ["--model", "~/m", "--ppl", "shakespeare", "--output", "new/deep/r.json"])[:2],
             "the evaluation failed")
    assert not (work / "new").exists()
    (work / "file").write_text("")
    one_line(*run_main(cli.main_evaluate, ["--model", "~/m", "--ppl", "shakespeare", "--output", "file/r.json"])[:2],
             "file is not a directory")


def test_a_folder_where_a_json_or_weights_file_is_read_is_named_and_nothing_is_left_open(tmp_path):
    """A review: with the reads opened without waiting, a folder read as JSON (or as a safetensors header) was named by
    its descriptor's number ("Is a directory: 53") and each such read left its descriptor open."""
    from elsa_ds import json_data
    from elsa_ds.files.weight_files import read_header

    folder = tmp_path / "x.safetensors"
    folder.mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(IsADirectoryError) as err:
            json_data.read(folder)
        assert err.value.filename == str(folder)
        with pytest.raises(IsADirectoryError):
            read_header(folder)
    assert len(os.listdir("/proc/self/fd")) == before


# ---- odd names --------------------------------------------------------------------------------------------------------
def test_a_path_with_a_line_break_keeps_the_refusal_one_line(tmp_path):
    """A seventh audit: a path naming a newline (or a terminal's escape) split the one-line refusal of every command,
    the path's second half on a line of its own. The line now escapes them as repr does."""
    from elsa_ds.sparse import cli as compress

    odd = str(tmp_path / "no\nsuch\x1b[2J\u2028x")
    shown = "no\\nsuch\\x1b[2J\\u2028x"
    one_line(*run_main(cli.main_prune, ["--deepspeed", odd + ".json", "--output_dir", str(tmp_path / "o")])[:2], shown)
    one_line(*run_main(cli.main_estimate, ["--deepspeed", odd + ".json", "--model", str(DEMO_MODEL_DIR)])[:2], shown)
    one_line(*run_main(cli.main_evaluate, ["--model", odd, "--ppl", "shakespeare"])[:2], shown)
    one_line(*run_main(compress.main, [odd, str(tmp_path / "c")])[:2], shown)
    one_line(*run_main(cli.main_prune, ["--deepspeed", "zero3", "--output_dir", str(tmp_path / "o"), "--steps", odd])[:2],
             shown)  # argparse's own refusal
