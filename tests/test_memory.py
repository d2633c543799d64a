"""The estimator: exact parameter counts of shipped configs, placement by offload choice, and the 27B target."""
from __future__ import annotations

import json

import pytest

from elsa_ds.capacity.memory import (CUDA_HOST_BYTES, RUNTIME_GPU_BYTES, ModelShape, estimate, gathered_params, model_shape,
                                     resolve_model_config, sub_groups)
from elsa_ds.capacity.resident import pinned_block, pinned_reserved
from elsa_ds.models import SHIPPED_CONFIGS
from elsa_ds.settings.config import DEMO_MODEL_DIR
from elsa_ds.zero.ds_config import DsConfig
from tests.conftest import run_entry

GIB = 2 ** 30


@pytest.mark.parametrize("model, billions", [("google/gemma-2-2b", 2.614), ("google/gemma-2-9b", 9.242), ("google/gemma-2-27b", 27.227),
                                             ("meta-llama/Llama-2-7b-hf", 6.738), ("meta-llama/Llama-2-13b-hf", 13.016)])
def test_shipped_configs_resolve_offline_with_known_sizes(model, billions):
    shape = model_shape(resolve_model_config(model))
    assert shape.num_params / 1e9 == pytest.approx(billions, abs=0.001)
    assert 0.7 * shape.num_params < shape.pruned_params < shape.num_params  # embeddings (and lm_head) excluded


def test_offload_moves_states_off_the_gpu_and_elsal_costs_three_bytes():
    shape = model_shape(resolve_model_config("google/gemma-2-27b"))
    plain = estimate(shape, DsConfig.load("ds_configs/zero3.json").raw, num_gpus=1)
    offload = estimate(shape, DsConfig.load("ds_configs/zero3_offload.json").raw, num_gpus=1)
    shipped = estimate(shape, DsConfig.load("ds_configs/zero3_offload_elsal.json").raw, num_gpus=1)  # minifloat 8-bit Adam
    bnb_config = DsConfig.load("ds_configs/zero3_offload_elsal.json").raw
    bnb_config["elsa"]["base_optimizer"] = "adam8bit"  # the paper's ELSA-L: bitsandbytes' codes
    elsal = estimate(shape, bnb_config, num_gpus=1)
    nvme = estimate(shape, DsConfig.load("ds_configs/zero3_nvme.json").raw, num_gpus=1)
    assert plain.breakdown["admm"]["per_gpu"] == pytest.approx(8 * shape.num_params)
    assert offload.breakdown["admm"]["per_node_cpu"] == pytest.approx(8 * shape.num_params)
    for low in (shipped, elsal):  # either code format: the ADMM state and the GPU side do not depend on it
        assert low.breakdown["admm"]["per_node_cpu"] / shape.num_params <= 3.0
        assert low.per_gpu_bytes < 24e9                    # the target: 27B with ELSA-L + CPU offload on one GPU
    # NVMe files: bf16 params, fp32 grads, masters, Adam moments, z, u = 2 + 4 + 4 + 8 + 8 bytes per parameter
    # (tensors under 1 MiB, the norms here, are not swapped), and the tied lm_head's own 16-bit file (bench/scale.py)
    assert 26 * (shape.num_params - 1e6) + 2 * shape.tied < nvme.nvme_bytes <= 26 * shape.num_params + 2 * shape.tied
    # what DeepSpeed still keeps in host memory under NVMe: the bf16 gradient accumulation buffer, max_in_cpu params
    # (pinned on a GPU host: the caching host allocator's next power of two)
    assert nvme.breakdown["grads"]["per_node_cpu"] >= 2 * shape.num_params
    assert nvme.breakdown["params"]["per_node_cpu"] == pinned_block(2 * 1e9) == 2**31
    assert nvme.per_node_cpu_bytes < 0.2 * offload.per_node_cpu_bytes
    eight = estimate(shape, DsConfig.load("ds_configs/zero3_offload.json").raw, num_gpus=8)
    assert eight.breakdown["optimizer"]["per_node_cpu"] == pytest.approx(offload.breakdown["optimizer"]["per_node_cpu"])


def test_cpu_accelerator_folds_the_gpu_into_host_memory_without_a_cuda_context():
    shape = model_shape(resolve_model_config("google/gemma-2-9b"))
    for name in ("zero3", "zero3_offload", "zero3_offload_elsal", "zero3_nvme"):
        ds = DsConfig.load(f"ds_configs/{name}.json").raw
        for section in ("offload_param", "offload_optimizer"):  # nothing pinned: the tensors' own bytes on both
            ds["zero_optimization"].get(section, {})["pin_memory"] = False
        cuda, cpu = estimate(shape, ds, num_gpus=2), estimate(shape, ds, num_gpus=2, device="cpu")
        assert cpu.per_gpu_bytes == 0.0 and cpu.nvme_bytes == cuda.nvme_bytes
        for key in ("params", "grads", "optimizer", "admm", "activations", "buffers"):
            a, b = cuda.breakdown[key], cpu.breakdown[key]
            assert b["per_node_cpu"] == pytest.approx(a["per_node_cpu"] + 2 * a["per_gpu"], rel=1e-9), (name, key)
        context = 2 * (CUDA_HOST_BYTES + RUNTIME_GPU_BYTES)
        assert cpu.breakdown["runtime"]["per_node_cpu"] == pytest.approx(cuda.breakdown["runtime"]["per_node_cpu"] - 2 * CUDA_HOST_BYTES)
        assert cpu.per_node_cpu_bytes < cuda.per_node_cpu_bytes + 2 * cuda.per_gpu_bytes - context + 1.0
        # the step's temporaries and rank 0's export are not live at once: the larger one counts; the CPU accelerator's
        # flats are CPU tensors, projected by the fused kernels (no score buffers), a GPU's by the eager reference
        if cuda.breakdown["workspace"]["per_gpu"]:
            assert 0 < cpu.breakdown["workspace"]["per_node_cpu"] < 2 * cuda.breakdown["workspace"]["per_gpu"]


def test_step_workspace_scales_with_the_sub_group_and_follows_the_optimizer():
    shape = model_shape(resolve_model_config("google/gemma-2-27b"))
    ds = DsConfig.load("ds_configs/zero3.json").raw
    big = estimate(shape, ds, num_gpus=8)                  # 3.4B entries per rank, sub-groups of 1e9
    ds["zero_optimization"]["sub_group_size"] = 1e8
    small = estimate(shape, ds, num_gpus=8)
    # without offload the step runs on the GPU: fp32 gradient (4 B) and projection (10 B) per entry of a sub-group
    assert big.breakdown["workspace"]["per_gpu"] + big.breakdown["activations"]["per_gpu"] > 14e9
    assert small.breakdown["workspace"]["per_gpu"] == 0.0  # a 1e8 sub-group's step fits in the forward/backward working set
    assert big.per_gpu_bytes - small.per_gpu_bytes > 4e9
    shape = model_shape(resolve_model_config("google/gemma-2-2b"))
    offload = estimate(shape, DsConfig.load("ds_configs/zero3_offload.json").raw, num_gpus=8)
    bnb_config = DsConfig.load("ds_configs/zero3_offload_elsal.json").raw
    bnb_config["elsa"]["base_optimizer"] = "adam8bit"
    elsal = estimate(shape, bnb_config, num_gpus=8)
    assert offload.breakdown["workspace"]["per_gpu"] == 0.0  # the optimizer steps on the CPU
    # bitsandbytes' CPU 8-bit Adam dequantizes both moments and copies the gradient: 20 bytes per entry
    assert elsal.breakdown["workspace"]["per_node_cpu"] == pytest.approx(20 * shape.num_params, rel=1e-9)
    # minifloat codes: the fused kernel on CPU (no step workspace: the projection's is what remains), its torch
    # reference on a GPU (32 bytes per entry)
    ds = DsConfig.load("ds_configs/zero3_offload_elsal.json").raw
    assert ds["elsa"]["base_optimizer"] == "adam8bit_minifloat"  # the shipped ELSA-L config
    mini = estimate(shape, ds, num_gpus=8)
    assert mini.breakdown["workspace"]["per_node_cpu"] < 20 * shape.num_params
    assert mini.breakdown["optimizer"] == elsal.breakdown["optimizer"] and mini.breakdown["admm"] == elsal.breakdown["admm"]
    ds = DsConfig.load("ds_configs/zero3.json").raw
    ds["elsa"] = {"base_optimizer": "adam8bit_minifloat", "z_dtype": "fp8", "u_dtype": "bf16"}
    on_gpu = estimate(shape, ds, num_gpus=8)
    ds["elsa"]["base_optimizer"] = "adam8bit"
    assert on_gpu.breakdown["workspace"]["per_gpu"] > estimate(shape, ds, num_gpus=8).breakdown["workspace"]["per_gpu"]


def test_sub_groups_are_cut_like_deepspeed_and_small_tensors_stay_off_nvme():
    m = 2**20
    shape = ModelShape(num_params=121 * m, pruned_params=110 * m, hidden=64, layers=1, heads=1, vocab=64, largest_layer_params=110 * m,
                       largest_param=60 * m, largest_pruned_param=60 * m,
                       params=[(60 * m, True), (50 * m, True), (10 * m, False), (1000, False)])
    # a sub-group closes once it holds >= sub_group_size, so it may overshoot by one parameter's partition
    assert [g.numel for g in sub_groups(shape, 1, 100 * m)] == [110 * m, 10 * m + 1000]
    assert [(g.numel, g.pruned, g.largest_pruned) for g in sub_groups(shape, 2, 100 * m)] == [(60 * m + 500, 55 * m, 30 * m)]
    ds = DsConfig.load("ds_configs/zero3_nvme.json").raw
    nvme = estimate(shape, ds, num_gpus=1, device="cpu")
    # the 1000-element tensor (2 and 4 KB) is below DeepSpeed's 1 MiB swap minimum: params and grads files skip it
    assert nvme.breakdown["params"]["nvme"] == 2 * 120 * m and nvme.breakdown["grads"]["nvme"] == 4 * 120 * m
    # NVMe's swap buffers are sized by the largest sub-group, not by sub_group_size
    ds["zero_optimization"]["sub_group_size"] = 100 * m
    buffers = estimate(shape, ds, num_gpus=1, device="cpu").breakdown["buffers"]["per_node_cpu"]
    assert buffers >= ds["zero_optimization"]["offload_optimizer"]["buffer_count"] * 110 * m * 4


def test_estimate_entry_point_json_and_errors(tmp_path):
    proc = run_entry("estimate.py", ["--model", "google/gemma-2-27b", "--deepspeed", "ds_configs/zero3_offload_elsal.json", "--json"])
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"num_params", "per_gpu_bytes", "per_node_cpu_bytes", "nvme_bytes", "breakdown"} <= last.keys()
    assert set(last["breakdown"]) >= {"params", "grads", "optimizer", "admm", "activations", "buffers"}
    bad = run_entry("estimate.py", ["--model", str(tmp_path / "nothing"), "--deepspeed", "ds_configs/zero3.json"], check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "elsa_ds: error" in bad.stderr


def test_a_refused_estimate_says_its_one_line_and_a_gpu_total_past_the_measured_gpus_gets_a_note(capsys):
    from elsa_ds.cli import main_estimate

    job = ["--model", "google/gemma-2-27b", "--deepspeed", "zero3", "--steps", "4096", "--batch_size", "8", "--seqlen", "2048"]
    assert main_estimate([*job, "--micro_batch", "3"]) == 2  # refused after the defaults rule resolved the job
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "multiple of 3" in out.err
    assert main_estimate([*job, "--num_gpus", "8", "--accelerator", "cuda"]) == 0  # ~90 GiB per GPU: an H200's, not an H100's
    out = capsys.readouterr().out
    assert "from the defaults rule" in out
    note = next(line for line in out.splitlines() if line.startswith("note:"))
    assert "more than an 80 GB H100 holds" in note and "a 141 GB H200 holds it" in note and "optimizer" in note


def test_the_gpu_note_names_the_gpu_it_compares_with():
    from elsa_ds.capacity.memory import Estimate, gpu_room_note

    def est(gib: float) -> Estimate:
        return Estimate(1, 1, 1, gib * GIB, 0.0, 0.0, breakdown={"activations": {"per_gpu": gib * GIB}})

    assert gpu_room_note(est(70)) is None
    assert "more than a 141 GB H200 holds" in gpu_room_note(est(150)) and "holds it" not in gpu_room_note(est(150))
    assert "--z_dtype fp8" in gpu_room_note(est(150))  # a walk: ELSA-L's states, the README's 62 GiB row, were not named
    assert gpu_room_note(est(30), ("this machine's GPU (L4)", 22.0 * GIB)).startswith(
        "note: 30.0 GiB per GPU is more than this machine's GPU (L4) holds (22.0 GiB to CUDA)")
    assert gpu_room_note(est(20), ("this machine's GPU (L4)", 22.0 * GIB)) is None

def _scale_job(layers: int, ranks: int = 1, freeze: bool = True):
    """bench/scale.py's model (Gemma-2-27B shapes, ``layers`` decoder layers) and its fitted zero3_nvme config."""
    from transformers import AutoConfig

    config = json.loads((SHIPPED_CONFIGS / "google/gemma-2-27b/config.json").read_text())
    shape = model_shape(AutoConfig.for_model(**{**config, "num_hidden_layers": layers}), freeze_embeddings=freeze)
    ds = DsConfig.load("ds_configs/zero3_nvme.json").raw
    zero = ds["zero_optimization"]
    zero["offload_param"].update(buffer_count=1, buffer_size=-(-shape.largest_param // ranks), max_in_cpu=0)
    zero["offload_optimizer"].update(buffer_count=6)
    zero.update(sub_group_size=1e7, stage3_max_reuse_distance=0)
    return shape, {**ds, "train_batch_size": ranks}


def test_frozen_embeddings_hold_no_optimizer_state_and_a_tied_head_leaves_a_second_file_on_nvme():
    trained, ds = _scale_job(1, freeze=False)
    frozen, _ = _scale_job(1)
    embedding = 256000 * 4608
    assert trained.trainable_params - frozen.trainable_params == embedding and frozen.frozen == [embedding]
    assert frozen.tied == embedding  # lm_head.weight is the embedding under a second name
    a, b = (estimate(s, ds, 1, micro_batch=1, seqlen=64, device="cpu") for s in (trained, frozen))
    # masters, moments and z, u (on NVMe) and the fp32 gradient file go; the 16-bit parameter files stay (twice: tied)
    assert a.nvme_bytes - b.nvme_bytes == pytest.approx(24 * embedding, rel=1e-3)
    assert b.breakdown["params"]["nvme"] == pytest.approx(2 * (frozen.num_params + embedding), rel=1e-3)
    # the optimizer's swap buffers are sized by the largest sub-group: the embedding when it is trained
    assert a.breakdown["buffers"]["per_node_cpu"] - b.breakdown["buffers"]["per_node_cpu"] > 6 * 4 * (embedding - 36864 * 4608)


def test_nvme_parameter_buffers_must_hold_the_largest_partition_not_the_whole_parameter():
    from elsa_ds.capacity.shapes import check_nvme_param_buffers
    from elsa_ds.errors import ElsaError
    from elsa_ds.models import meta_model

    meta = meta_model(resolve_model_config("google/gemma-2-2b"))
    largest = max(p.numel() for p in meta.parameters())
    ds = {"zero_optimization": {"offload_param": {"device": "nvme", "buffer_size": -(-largest // 4)}}}
    check_nvme_param_buffers(meta, ds, world=4)
    with pytest.raises(ElsaError, match="buffer_size"):
        check_nvme_param_buffers(meta, ds, world=2)


def test_estimate_takes_the_jobs_memory_settings_and_resolves_them_as_the_job_does(tmp_path, capsys):
    """elsa-estimate's figure is the pre-flight check's for the same flags: the prune parser's settings, the defaults rule
    (at 100 steps and 70 % it starts from SparseGPT's pruned model: a one-shot warm start on rank 0), the engine config."""
    from elsa_ds.capacity.memory import job_estimate
    from elsa_ds.cli import main_estimate, prune_parser, settings_from_args
    from elsa_ds.plan.defaults_applied import apply_defaults

    model = "google/gemma-2-2b"
    flags = ["--deepspeed", "zero3_offload", "--freeze_embeddings", "--base_optimizer", "adam8bit_minifloat", "--z_dtype", "fp8",
             "--u_dtype", "bf16", "--seqlen", "512", "--steps", "100"]
    figures = {}
    for name, extra in (("job", []), ("trained embeddings", ["--no_freeze_embeddings"]), ("fp32 states", ["--z_dtype", "fp32",
                        "--u_dtype", "fp32", "--base_optimizer", "cpu_adam"]), ("dense start", ["--lr", "1e-4"])):
        assert main_estimate(["--model", model, *flags, *extra, "--json"]) == 0
        figures[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    opts, cfg, ds_config = settings_from_args(prune_parser().parse_args([*flags, "--model", model, "--output_dir", str(tmp_path)]))
    config = resolve_model_config(model)
    cfg, defaults = apply_defaults(cfg, config)
    assert defaults["applied"]["init_mask"] == "sparsegpt"
    ds = ds_config.resolve(cfg, 1, config.hidden_size, check_paths=False)
    job = job_estimate(model_shape(config, cfg.targets, freeze_embeddings=True), ds.raw, cfg, 1)
    assert figures["job"]["per_node_cpu_bytes"] == job.per_node_cpu_bytes and figures["job"]["phases"] == job.phases
    assert "warm start" in figures["job"]["phases"] and "warm start" not in figures["dense start"]["phases"]  # a user's lr
    assert figures["trained embeddings"]["breakdown"]["optimizer"]["per_node_cpu"] > figures["job"]["breakdown"]["optimizer"]["per_node_cpu"]
    assert figures["fp32 states"]["breakdown"]["admm"]["per_node_cpu"] == pytest.approx(
        8 / 3 * figures["job"]["breakdown"]["admm"]["per_node_cpu"])


@pytest.mark.parametrize("layers, config, measured_gib", [(4, "zero3_offload", 98), (4, "zero3_offload_elsal", 72)])
def test_gemma2_27b_cut_to_layers_on_a_gpu_host_within_the_margin_of_the_h200_runs(tmp_path, layers, config, measured_gib):
    """The runs of issue 43 (H200, 125.9 GiB host RAM; Gemma-2-27B's shapes cut to 4 layers, --random_init
    --freeze_embeddings, seqlen 2048, batch 1): ~98 GiB host in fp32 ELSA, ~72 in ELSA-L; 8 layers of ELSA-L killed by the
    kernel at 125.4 GiB. Before pinned buffers were counted as the caching host allocator holds them: 75.1, 59.3, 95.2."""
    from elsa_ds.capacity.memory import estimate_job

    settings = {"freeze_embeddings": True, "seqlen": 2048, "batch_size": 1, "micro_batch": 1}
    config_json = json.loads((SHIPPED_CONFIGS / "google/gemma-2-27b/config.json").read_text())
    for n in (layers, 8):
        (tmp_path / str(n)).mkdir()
        (tmp_path / str(n) / "config.json").write_text(json.dumps({**config_json, "num_hidden_layers": n}))
    est = estimate_job(str(tmp_path / str(layers)), f"ds_configs/{config}.json", 1, settings=settings)
    assert 0.85 < est.per_node_cpu_bytes / (measured_gib * GIB) < 1.15
    if config == "zero3_offload_elsal":
        assert estimate_job(str(tmp_path / "8"), f"ds_configs/{config}.json", 1, settings=settings).per_node_cpu_bytes > 125.4 * GIB


def test_the_caching_host_allocator_rounds_up_and_keeps_freed_blocks():
    assert [pinned_block(n) for n in (0, 1, 3, 4096, 4097, 4.5e9)] == [0.0, 1.0, 4.0, 4096.0, 8192.0, 2.0**33]
    # a freed block serves a later tensor of its size class only, and is never given back
    assert pinned_reserved([("pin", 3000), ("free", 3000), ("pin", 4000)]) == 4096
    assert pinned_reserved([("pin", 3000), ("free", 3000), ("pin", 5000)]) == 4096 + 8192
    assert pinned_reserved([("pin", 5000), ("pin", 3000)]) == 8192 + 4096



def test_the_estimate_takes_its_model_from_the_recipe_or_the_demo_as_the_job_does(capsys):
    """A user's walk through the README: `elsa-estimate --recipe gemma-2-27b-s70` asked for --model the recipe names.
    Without --model the estimate sizes the recipe's model, or elsa-prune's default (the embedded demo)."""
    from elsa_ds.cli import main_estimate

    runs = {}
    for name, flags in (("recipe", ["--recipe", "gemma-2-27b-s70"]), ("recipe, its model named", ["--recipe", "gemma-2-27b-s70",
                        "--model", "google/gemma-2-27b"]), ("demo", [])):
        assert main_estimate(["--deepspeed", "zero3_offload", *flags, "--json"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        runs[name] = (next(line for line in out if " parameters (" in line), json.loads(out[-1]))
    assert runs["recipe"][0].startswith("google/gemma-2-27b: 27.") and runs["recipe"][1] == runs["recipe, its model named"][1]
    assert "demo" in runs["demo"][0] and " M parameters" in runs["demo"][0]
    # the run's time says what it leaves out: the defaults rule's SparseGPT start on the demo, none on the recipe's 4096 steps
    assert runs["demo"][1]["time"]["uncounted"][0] == "the sparsegpt warm start"
    assert not any("warm start" in part for part in runs["recipe"][1]["time"]["uncounted"])


def test_the_shipped_nvme_configs_parameter_buffers_hold_the_largest_partition_at_any_scale():
    """zero3_nvme's offload_param.buffer_size is "auto": the largest parameter's partition (at 27B the 256k x 4608
    embedding: 1.18e9 elements on one rank, 1.47e8 on 8), never below DeepSpeed's 1e8. With a fixed 1e8 the README's
    27B command was refused on one node while elsa-estimate priced it (a user's walk, 2026-11-30)."""
    from elsa_ds.capacity.memory import estimate_job, format_estimate, resolved_job
    from elsa_ds.capacity.shapes import check_nvme_param_buffers
    from elsa_ds.errors import ElsaError
    from elsa_ds.models import meta_model
    from elsa_ds.settings.config import resolve_config

    view = DsConfig.load("zero3_nvme")
    assert view.raw["zero_optimization"]["offload_param"]["buffer_size"] == "auto"
    cfg = resolve_config(view.raw, {"model": "google/gemma-2-27b", "nvme_path": "/tmp", "batch_size": 16})
    meta = meta_model(resolve_model_config("google/gemma-2-27b"))
    largest = max(p.numel() for p in meta.parameters())
    assert largest == 256000 * 4608
    for world, expected in ((1, largest), (8, -(-largest // 8)), (16, 1e8)):
        shape, ds = resolved_job(cfg, view, world)
        assert ds["zero_optimization"]["offload_param"]["buffer_size"] == expected
        check_nvme_param_buffers(meta, ds, world)  # what the job checks before loading: passes
    fixed = json.loads(json.dumps(view.raw))
    fixed["zero_optimization"]["offload_param"]["buffer_size"] = 1e8
    with pytest.raises(ElsaError, match="buffer_size is 1e\\+08 elements but .* 147,456,000 per rank on 8"):
        check_nvme_param_buffers(meta, fixed, 8)
    # the swapper's 5 buffers of 2-byte elements are in the host estimate: 5 x 2 x (1.47e8 - 1e8) more than a 1e8 buffer
    one_node, two_nodes = (estimate_job("google/gemma-2-27b", "zero3_nvme", 8, n, {"nvme_path": "/tmp", "batch_size": 16})
                           for n in (1, 2))
    assert one_node.breakdown["buffers"]["per_node_cpu"] >= 8 * 5 * 2 * -(-largest // 8)
    table = format_estimate(two_nodes, "google/gemma-2-27b", "zero3_nvme", 8, 2)
    assert "NVMe per node" in table and f"{two_nodes.nvme_bytes / 2 / 2**30:12.2f} GiB" in table.splitlines()[-1]
    assert "-0.00" not in table  # a walk: rounding left rows of "-0.00 GiB"
    two_nodes.breakdown["runtime"]["per_gpu"] = -1e-6
    assert "-0.00" not in format_estimate(two_nodes, "google/gemma-2-27b", "zero3_nvme", 8, 2)
    assert "2 node(s) x 8 GPU(s)" in table and "x 8 CPU rank(s)" in format_estimate(two_nodes, "m", "z", 8, 2, "cpu")


def test_an_auto_nvme_buffer_without_the_models_shape_is_refused_not_left_to_deepspeeds_default():
    """DeepSpeed reads an "auto" buffer_size as its default 1e8, the size that failed at 27B: a caller that cannot give
    the model's largest parameter gets one line instead (the job and the estimator always give it)."""
    from elsa_ds.errors import ElsaError
    from elsa_ds.settings.config import resolve_config

    view = DsConfig.load("zero3_nvme")
    cfg = resolve_config(view.raw, {"model": "google/gemma-2-2b", "nvme_path": "/tmp"})
    with pytest.raises(ElsaError, match='buffer_size is "auto", which is resolved from the model\'s largest parameter'):
        view.resolve(cfg, 1, check_paths=False)
    assert view.resolve(cfg, 1, check_paths=False, largest_param=10).raw["zero_optimization"]["offload_param"]["buffer_size"] == 1e8


def test_the_estimate_sizes_the_disk_under_the_output_dir_as_the_jobs_check_does(tmp_path, capsys, monkeypatch):
    """A user's walk planning 27B (2026-11-30): `--save_interval 256` asks ~1.5 TiB of disk, which the job's pre-flight check
    counted and elsa-estimate did not show. Now it prints that disk, part by part, from the same function as the check;
    a job without --save_interval still learns what each checkpoint would take."""
    from elsa_ds.capacity import preflight
    from elsa_ds.cli import main_estimate, prune_parser, settings_from_args
    from elsa_ds.models import meta_model
    from elsa_ds.plan.defaults_applied import apply_defaults

    model = "google/gemma-2-2b"
    flags = ["--deepspeed", "zero3_offload", "--seqlen", "512", "--steps", "100", "--export_format", "sparse"]
    saved = ["--save_interval", "25", "--keep_checkpoints", "1"]
    said = {}
    for name, extra in (("saved", saved), ("unsaved", [])):
        assert main_estimate(["--model", model, *flags, *extra, "--json"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        said[name] = (next(line for line in out if line.startswith("disk under --output_dir")), json.loads(out[-1])["output_dir_bytes"])
    line, parts = said["saved"]
    assert parts["checkpoints"] > parts["export"] > parts["sparse export"] > 0 and parts["warm-start mask"] > 0  # 70 %: SparseGPT start
    assert "2 x " in line and "every 25 steps" in line and "--keep_checkpoints 1" in line
    assert said["unsaved"][1]["checkpoints"] == 0 and "no checkpoints (--save_interval 0; each would take" in said["unsaved"][0]
    assert said["unsaved"][1]["export"] == parts["export"]
    # the job's own check, for the same flags, counts these bytes under its --output_dir
    opts, cfg, ds_config = settings_from_args(prune_parser().parse_args([*flags, *saved, "--model", model, "--output_dir", str(tmp_path / "out")]))
    config = resolve_model_config(model)
    cfg, _ = apply_defaults(cfg, config)
    meta = meta_model(config)
    ds = ds_config.resolve(cfg, 1, config.hidden_size, check_paths=False, largest_param=max(p.numel() for p in meta.parameters()))
    counted = {}
    monkeypatch.setattr(preflight, "disk_needs", lambda writes, machine: counted.update(writes) or [])
    monkeypatch.setattr(preflight, "this_machine", lambda paths: preflight.Machine(host=1e15))
    preflight.check_elsa(meta, ds.raw, cfg, opts, world=1)
    assert counted == {(tmp_path / "out").resolve(): pytest.approx(sum(parts.values()))}


def test_torchs_linear_keeps_every_gathered_weight_until_its_backward_beside_the_gathered_again():
    """memory_efficient_linear off: F.linear saves a view of each gathered weight, which ZeRO-3's release cannot free, and
    the backward gathers the weight again beside it: at least every pruned weight and the head twice more on the GPU;
    with checkpointing the layers are recomputed and only the head (outside them) stays. Off as DeepSpeed reads a bool."""
    shape = model_shape(resolve_model_config("google/gemma-2-9b"))
    ds = DsConfig.load("ds_configs/zero3.json").raw
    ds = {**ds, "zero_optimization": {**ds["zero_optimization"], "stage3_max_reuse_distance": 0}}  # nothing kept for reuse
    half = 2  # bf16 weights
    for off in (False, "false", 0):
        torch_linear = {**ds, "zero_optimization": {**ds["zero_optimization"], "memory_efficient_linear": off}}
        for checkpointing, device in ((False, "cuda"), (True, "cuda"), (False, "cpu")):
            wrapped, native = (estimate(shape, d, num_gpus=1, micro_batch=1, gradient_checkpointing=checkpointing, device=device)
                               .breakdown["activations"]["per_gpu" if device == "cuda" else "per_node_cpu"] for d in (ds, torch_linear))
            if checkpointing:
                assert native - wrapped == pytest.approx(half * shape.largest_param)
            else:  # whatever DeepSpeed's linear has left to prefetch, torch's has gathered already
                prefetch = ds["zero_optimization"]["stage3_prefetch_bucket_size"]
                assert native - wrapped >= half * (shape.pruned_params + shape.largest_param - prefetch)
    assert estimate(shape, {**ds, "zero_optimization": {**ds["zero_optimization"], "memory_efficient_linear": "true"}},
                    num_gpus=1).per_gpu_bytes == estimate(shape, ds, num_gpus=1).per_gpu_bytes


def test_parameters_used_again_within_the_reuse_distance_stay_gathered():
    """From the second step ZeRO-3 keeps gathered from the forward to the backward what it uses again within
    stage3_max_reuse_distance entries (measured on real engines: bench/gathered.py, tests/test_memory_engine.py): the
    shipped 1e9 keeps a model up to 1e9 entries whole, 1e9 entries of a larger one, and the head at least (a 27B's)."""
    ds = DsConfig.load("ds_configs/zero3.json").raw
    zero = ds["zero_optimization"]
    assert zero["stage3_max_reuse_distance"] == 1e9
    none = {**zero, "stage3_max_reuse_distance": 0}
    shapes = {m: model_shape(resolve_model_config(m)) for m in (str(DEMO_MODEL_DIR), "google/gemma-3-1b-pt", "google/gemma-2-9b",
                                                                  "google/gemma-2-27b")}
    for name, shape in shapes.items():
        for device in ("cuda", "cpu"):
            live, kept = (gathered_params(shape, z, False, device) for z in (none, zero))
            assert shape.largest_param <= live < shape.num_params
            if name in (str(DEMO_MODEL_DIR), "google/gemma-3-1b-pt"):
                assert kept == shape.num_params  # up to 1e9 entries: the whole model stays
            elif name == "google/gemma-2-9b":
                assert kept == 1e9 > live  # 1e9 of its 9.2 B entries
            else:
                assert kept == live == shape.largest_param  # the head (1.18 B entries) alone, as in flight anyway
            with_reuse, without = (estimate(shape, {**ds, "zero_optimization": z}, num_gpus=1, micro_batch=1, device=device)
                                   .breakdown["activations"]["per_gpu" if device == "cuda" else "per_node_cpu"] for z in (zero, none))
            if shape.num_params - kept > zero["stage3_prefetch_bucket_size"]:  # bf16: two bytes an entry more
                assert with_reuse - without == pytest.approx(2 * (kept - live))
            else:  # a model kept (nearly) whole has that much less left to prefetch
                assert 0 <= with_reuse - without <= 2 * (kept - live)
    # torch's F.linear keeps every layer's weights anyway: those kept for reuse are among them, not on top
    native = {**zero, "memory_efficient_linear": False}
    nine_b = shapes["google/gemma-2-9b"]
    without = {**native, "stage3_max_reuse_distance": 0}
    assert gathered_params(nine_b, native, False, "cuda") == gathered_params(nine_b, without, False, "cuda")
