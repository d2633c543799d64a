"""The pre-flight memory check: a run that cannot fit stops in seconds, before anything is loaded, with one line that
names the shortfall and what would fit."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from elsa_ds.capacity import alternatives, preflight
from elsa_ds.capacity.memory import PHASES, estimate, model_shape, resolve_model_config
from elsa_ds.errors import ElsaError
from elsa_ds.files import procfs
from elsa_ds.models import meta_model
from elsa_ds.settings.config import DEMO_MODEL_DIR, resolve_config
from elsa_ds.settings.options import JobOptions
from elsa_ds.zero.ds_config import DsConfig
from tests.conftest import run_entry, run_fails

GIB = 2 ** 30


def _too_large_model(d, ram: float):
    """A Gemma-2 config whose ZeRO-3 state with CPU offload (~28 bytes per parameter) is twice ``ram``, with the demo's
    tokenizer and no weights."""
    per_layer = 251_658_240  # hidden 4096, MLP 16384, 16 heads / 8 KV heads of 256: attention 50.3M + MLP 201.3M
    layers = int(2 * ram / (28 * per_layer)) + 1
    d.mkdir()
    config = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 16384, "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 256, "max_position_embeddings": 4096, "sliding_window": 1024, "pad_token_id": 0, "eos_token_id": 1,
              "bos_token_id": 2, "tie_word_embeddings": True}
    (d / "config.json").write_text(json.dumps(config))
    for f in DEMO_MODEL_DIR.glob("tokenizer*.json"):
        shutil.copy(f, d / f.name)
    return d


def test_cpu_offload_run_too_large_for_this_machine_is_refused_before_loading(tmp_path):
    import psutil

    model = _too_large_model(tmp_path / "model", psutil.virtual_memory().total)
    started = time.time()
    line = run_fails("prune.py", ["--deepspeed", "ds_configs/zero3_offload.json", "--model", str(model), "--random_init",
                                  "--dataset", "shakespeare", "--output_dir", str(tmp_path / "out")],
                     "host memory", "this node has", "±15%", "--ignore_memory_check")
    assert time.time() - started < 120, "the check must not load anything"
    assert not (tmp_path / "out").exists()
    need = float(line.split("needs ~")[1].split(" GiB")[0].replace(",", "")) * GIB
    assert need > 1.5 * psutil.virtual_memory().total
    # what the need is made of: its largest rows (the optimizer's states first: 12 of ~28 bytes a parameter) and its phase
    parts = line.split("largest: ")[1].split("; peak phase: ")
    assert parts[0].startswith("fp32 masters + moments ") and parts[1].split(")")[0] in (*PHASES, "warm start")
    # every change tried, with its estimate: ELSA-L's states, NVMe for the optimizer states or the parameters or both,
    # --freeze_embeddings, more nodes; those that fit the machine before those that do not
    have = float(line.split("this node has ")[1].split(" GiB")[0].replace(",", "")) * GIB
    changes = dict(_changes(line))
    for label in ("ELSA-L's states", "the optimizer states on NVMe", "the parameters on NVMe", "ds_configs/zero3_nvme.json",
                  "--freeze_embeddings", "nodes"):
        assert any(label in change for change in changes), (label, line)
    for change, (host, fits) in changes.items():  # (the parameters on NVMe may cost more: max_in_cpu and swap buffers stay)
        assert (host <= have) == fits and (host < need or "parameters on NVMe" in change), (change, line)
    assert changes[next(c for c in changes if "optimizer states on NVMe" in c)][0] < 0.5 * need  # 12 + 8 of ~28 bytes


def _changes(line: str):
    """(change, (host bytes it estimates, whether it was listed as fitting)) from a refusal's hint."""
    hint = line.split("available: ")[1].split("; --ignore_memory_check")[0]
    for verdict in hint.split("; "):
        fits = verdict.startswith("would fit: ")
        for entry in verdict.split(": ", 1)[1].split("), "):
            change, cost = entry.rsplit(" (~", 1)
            yield change, (float(cost.split(" GiB host")[0].replace(",", "")) * GIB, fits)


def _job(tmp_path, config: str, **settings):
    ds_config = DsConfig.load(config)
    cfg = resolve_config(ds_config.raw, {"model": "google/gemma-2-2b", "seqlen": 512, **settings})
    opts = JobOptions(deepspeed=config, output_dir=tmp_path / "out")
    model_config = resolve_model_config("google/gemma-2-2b")
    meta = meta_model(model_config)
    ds = ds_config.engine_config(cfg, 1, model_config.hidden_size, largest_param=max(p.numel() for p in meta.parameters()))
    return meta, ds, cfg, opts


def _host(monkeypatch, host: float):
    real = preflight.this_machine
    monkeypatch.setattr(preflight, "this_machine", lambda paths: preflight.Machine(host=host, gpu=None, disks=real(paths).disks))


def _estimate(ds_name: str, **elsa) -> float:
    shape = model_shape(resolve_model_config("google/gemma-2-2b"))
    ds = DsConfig.load(ds_name).raw
    ds["zero_optimization"].get("offload_param", {})["buffer_size"] = shape.largest_param
    return estimate(shape, ds, 1, micro_batch=1, seqlen=512, elsa=elsa, device="cpu").per_node_cpu_bytes


def test_another_config_is_priced_with_the_settings_this_jsons_elsa_block_gave(tmp_path):
    """An ELSA-L job (zero3_offload_elsal.json's "elsa" block) refused for memory listed "ds_configs/zero3_offload.json"
    at the ELSA-L job's estimate, but that config has no "elsa" block: run as listed, the job holds fp32 z, u and Adam
    moments. The listing names the flags that keep the block's settings under it, the price it gives."""
    import psutil

    model = _too_large_model(tmp_path / "model", psutil.virtual_memory().total)
    line = run_fails("prune.py", ["--deepspeed", "ds_configs/zero3_offload_elsal.json", "--model", str(model), "--random_init",
                                  "--dataset", "shakespeare", "--output_dir", str(tmp_path / "out")], "host memory")
    changes = dict(_changes(line))
    nvme = [c for c in changes if c.startswith("ds_configs/zero3_nvme.json")]
    assert len(nvme) == 1 and nvme[0].endswith(" with --base_optimizer adam8bit_minifloat --z_dtype fp8 --u_dtype bf16"), line
    # zero3_offload.json with those flags is this very job (the same zero_optimization): not listed (a walk)
    assert not any(c.startswith("ds_configs/zero3_offload.json") for c in changes), line
    assert not any("ELSA-L's states" in c for c in changes)  # the job has them


def test_the_flags_that_carry_a_block_over_read_back_as_the_settings_they_name(tmp_path):
    """A review: the carried flags were printed as `--freeze_embeddings True --betas [0.9, 0.95]`, which elsa-prune
    refuses; and the GPU line (zero3.json has no "elsa" block either) carried none. Each flag now parses back, through
    elsa-prune's own parser, into the value the estimate priced."""
    import shlex

    from elsa_ds.cli import prune_parser

    meta, ds, _, _ = _job(tmp_path, "ds_configs/zero3_offload.json")
    block = {"freeze_embeddings": True, "gradient_checkpointing": False, "betas": [0.9, 0.95], "z_dtype": "fp8",
             "eval_ppl": ["shakespeare"], "lmda_schedule": "constant"}
    cfg = resolve_config({"elsa": block}, {"model": "google/gemma-2-2b", "seqlen": 512})
    job = alternatives.Run(meta, ds, cfg, "mine", "cuda", 1, 1, {"elsa": block})
    kept = alternatives.kept_flags(job, {"z_dtype": "fp32"})
    assert kept.startswith(" with --freeze_embeddings --no_gradient_checkpointing --betas 0.9 0.95 "), kept
    parsed = vars(prune_parser().parse_args(["--deepspeed", "z", "--output_dir", "o", *shlex.split(kept.removeprefix(" with "))]))
    given = {k: v for k, v in parsed.items() if k in type(cfg).model_fields and k not in ("model", "seqlen")}
    again = resolve_config({}, {"model": "google/gemma-2-2b", "seqlen": 512, **given})
    assert {k: getattr(again, k) for k in block if k != "z_dtype"} == {k: getattr(cfg, k) for k in block if k != "z_dtype"}
    assert "z_dtype" not in kept  # the other config's block sets it
    machine = preflight.Machine(host=1.0, gpu=1.0)
    assert "everything on the GPUs (ds_configs/zero3.json with --freeze_embeddings --no_gradient_checkpointing" in \
        alternatives.alternatives(job, machine)


def test_more_nodes_are_priced_with_the_json_resolved_for_their_ranks_and_the_batch_they_need(tmp_path):
    """A walk (2026-12-04): "64 nodes (~27 GiB host + 10 GiB NVMe)" where elsa-estimate says 15 GiB for that job: the
    node count was priced with the config resolved for this job's one rank (its "auto" parameter buffers 14x too large,
    64 accumulation steps), and at 32 nodes the global batch of 8 cannot be split at all, which the line did not say."""
    from elsa_ds.capacity.memory import job_estimate

    meta, ds, cfg, _ = _job(tmp_path, "ds_configs/zero3_nvme.json", nvme_path=str(tmp_path))
    source = DsConfig.load("ds_configs/zero3_nvme.json").raw
    job = alternatives.Run(meta, ds, cfg, "zero3_nvme", "cpu", 1, 1, source)
    e, batch = job.on_nodes(16)
    assert batch == 16 and ds["train_batch_size"] == 8  # the next multiple of micro batch 1 x 16 ranks
    largest = max(p.numel() for p in meta.parameters())
    direct = DsConfig(source).engine_config(cfg.model_copy(update={"batch_size": 16}), 16, meta.config.hidden_size,
                                            check_paths=False, largest_param=largest)
    assert direct["zero_optimization"]["offload_param"]["buffer_size"] < ds["zero_optimization"]["offload_param"]["buffer_size"]
    shape = model_shape(meta.config, cfg.targets, model=meta)
    assert e.per_node_cpu_bytes == job_estimate(shape, direct, cfg, 1, 16, "cpu").per_node_cpu_bytes
    assert e.per_node_cpu_bytes < job.estimate(nodes=16).per_node_cpu_bytes  # the old pricing: this rank's buffers
    hint = alternatives.alternatives(job, preflight.Machine(host=1.01 * e.per_node_cpu_bytes))
    assert "would fit: 16 nodes with --batch_size 16 (~" in hint, hint
    assert "NVMe, tight: within the estimate's ±15%)" in hint, hint  # 1 % of room: it would start with a warning


def test_refusal_names_the_shipped_config_that_fits_and_the_warning_when_ignored(tmp_path, monkeypatch, capsys):
    meta, ds, cfg, opts = _job(tmp_path, "ds_configs/zero3_offload.json")
    nvme, offload = _estimate("ds_configs/zero3_nvme.json"), _estimate("ds_configs/zero3_offload.json")
    host = 1.02 * nvme
    assert offload > host, "the scenario needs NVMe to fit where CPU offload does not"
    _host(monkeypatch, host)
    with pytest.raises(ElsaError) as err:
        preflight.check_elsa(meta, ds, cfg, opts, world=1)
    message = str(err.value)
    assert "\n" not in message and message.startswith("needs ~") and "host memory" in message
    assert "would fit: ds_configs/zero3_nvme.json" in message and "NVMe)" in message and "--ignore_memory_check" in message
    fitting = {change for change, (_, fits) in _changes(message) if fits}
    assert "--freeze_embeddings" not in fitting and any("zero3_nvme.json" in change for change in fitting)
    opts.ignore_memory_check = True
    preflight.check_elsa(meta, ds, cfg, opts, world=1)  # proceeds
    assert "warning" in capsys.readouterr().err


def test_an_elsa_job_short_of_disk_alone_is_told_what_frees_it(tmp_path, monkeypatch):
    """An audit (2026-12-07): the ELSA job's disk refusal offered only --ignore_memory_check, which trained the whole run
    and failed at the export; it names what frees the disk, as the one-shot job's does."""
    meta, ds, cfg, opts = _job(tmp_path, "ds_configs/zero3_offload.json")
    real = preflight.this_machine
    monkeypatch.setattr(preflight, "this_machine", lambda paths: preflight.Machine(
        host=1e15, gpu=None, disks={dev: 1e3 for dev in real(paths).disks}))
    with pytest.raises(ElsaError) as err:
        preflight.check_elsa(meta, ds, cfg, opts, world=1)
    assert "disk at" in str(err.value) and ": free space there, or choose another --output_dir;" in str(err.value), err.value


def test_a_run_that_fits_passes_and_one_inside_the_margin_warns(tmp_path, monkeypatch, capsys):
    meta, ds, cfg, opts = _job(tmp_path, "ds_configs/zero3_offload.json")
    need = _estimate("ds_configs/zero3_offload.json")
    _host(monkeypatch, 2 * need)
    preflight.check_elsa(meta, ds, cfg, opts, world=1)
    said = capsys.readouterr()
    assert said.err == ""
    assert f"h for the run ({cfg.steps} steps; not counted: " in said.out and "at the typical rates of a " in said.out
    assert f"(this job may use {procfs.usable_cpus():g} CPUs; elsa-estimate" in said.out
    assert "--num_gpus 1 --accelerator cpu --measure" in said.out  # the estimate that times this machine, for this job
    _host(monkeypatch, 1.05 * need)  # fits unless the estimate is more than 5 % low: start, with a warning
    preflight.check_elsa(meta, ds, cfg, opts, world=1)
    assert "may not fit" in capsys.readouterr().err
    _host(monkeypatch, 0.97 * need)  # the estimate over what there is (the 8-layer ELSA-L job on the H200: 131 of 126 GiB)
    with pytest.raises(ElsaError, match="host memory"):
        preflight.check_elsa(meta, ds, cfg, opts, world=1)


def test_on_gpus_that_hold_it_everything_on_the_gpus_is_suggested(tmp_path):
    """An 8 x H100 node with less host memory than an offloaded 27B job takes was pointed at NVMe (10x slower by the
    estimate) while 80 GB GPUs hold the whole job with ELSA-L's states (README: 62 GiB each, 11 h). On a GPU host the
    refusal prices that too (ds_configs/zero3.json, bitsandbytes' 8-bit Adam, fp8 z, bf16 u); on a CPU one it cannot."""
    meta, ds, cfg, opts = _job(tmp_path, "ds_configs/zero3_offload.json")
    offloaded = alternatives.Run(meta, ds, cfg, "zero3_offload", "cuda", 1, 1)
    resident_ds = {**ds, "zero_optimization": DsConfig.load("ds_configs/zero3.json").raw["zero_optimization"]}
    resident = offloaded.estimate(resident_ds, alternatives.GPU_ELSAL)
    assert resident.per_node_cpu_bytes < 0.3 * offloaded.estimate().per_node_cpu_bytes
    machine = preflight.Machine(host=1.1 * resident.per_node_cpu_bytes, gpu=1.1 * resident.per_gpu_bytes)
    hint = alternatives.alternatives(offloaded, machine)
    fitting = {change for change, (_, fits) in _changes(f"available: {hint}; --ignore_memory_check") if fits}
    assert any(c.startswith("everything on the GPUs (ds_configs/zero3.json, ELSA-L's states: --base_optimizer adam8bit")
               for c in fitting), hint
    on_cpu = alternatives.Run(meta, ds, cfg, "zero3_offload", "cpu", 1, 1)
    assert "everything on the GPUs" not in alternatives.alternatives(on_cpu, preflight.Machine(host=machine.host))


def test_deepspeeds_linear_is_suggested_where_the_json_turned_it_off(tmp_path):
    """Torch's F.linear (memory_efficient_linear off) keeps every gathered weight on the GPU until its backward: a job
    that does not fit for it is told what turning DeepSpeed's linear back on would take; a job with it is not."""
    meta, ds, cfg, opts = _job(tmp_path, "ds_configs/zero3_offload.json", gradient_checkpointing=False)
    off = {**ds, "zero_optimization": {**ds["zero_optimization"], "memory_efficient_linear": False}}
    job = alternatives.Run(meta, off, cfg, "zero3_offload", "cuda", 1, 1)
    on = job.estimate({**off, "zero_optimization": {**off["zero_optimization"], "memory_efficient_linear": True}})
    assert on.per_gpu_bytes < job.estimate().per_gpu_bytes
    machine = preflight.Machine(host=10 * on.per_node_cpu_bytes, gpu=1.01 * on.per_gpu_bytes)
    hint = alternatives.alternatives(job, machine)
    fitting = {change for change, (_, fits) in _changes(f"available: {hint}; --ignore_memory_check") if fits}
    assert "DeepSpeed's linear (memory_efficient_linear true)" in fitting
    plain = alternatives.Run(meta, ds, cfg, "zero3_offload", "cuda", 1, 1)
    assert "memory_efficient_linear" not in alternatives.alternatives(plain, machine)


def test_freezing_the_embeddings_is_suggested_when_it_fits(tmp_path, monkeypatch):
    meta, ds, cfg, opts = _job(tmp_path, "ds_configs/zero3_nvme.json", nvme_path=str(tmp_path))
    shape = model_shape(meta.config, model=meta_model(meta.config), freeze_embeddings=True)
    frozen = estimate(shape, ds, 1, micro_batch=1, seqlen=512, device="cpu").per_node_cpu_bytes
    _host(monkeypatch, 1.05 * frozen)
    with pytest.raises(ElsaError, match="--freeze_embeddings"):
        preflight.check_elsa(meta, ds, cfg, opts, world=1)


def test_a_local_rank_past_the_nodes_gpus_is_one_line(tmp_path, monkeypatch):
    """An audit (2026-12-06, read on a CPU box): LOCAL_RANK past the GPUs CUDA shows was CUDA's "invalid device ordinal"
    traceback from the memory check. The GPUs are what a CUDA host would show (a CPU box has none to ask)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ElsaError, match=r"LOCAL_RANK=2, but this node shows 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES='0,1'\)"):
        preflight.this_machine([tmp_path])


def test_disk_needs_on_one_file_system_add_up(tmp_path):
    machine = preflight.this_machine([tmp_path])
    free = next(iter(machine.disks.values()))
    needs = preflight.disk_needs({tmp_path / "nvme": 0.55 * free, tmp_path / "out": 0.55 * free}, machine)
    assert len(needs) == 1 and needs[0].need == pytest.approx(1.1 * free) and needs[0].refused  # bytes on disk: no margin
    needs = preflight.disk_needs({tmp_path / "nvme": 0.45 * free, tmp_path / "out": 0.45 * free}, machine)
    assert not needs[0].refused and not needs[0].tight and "±" not in needs[0].line()
    assert alternatives.gib_text(3 * 2**20) == "3.0 MiB" and alternatives.gib_text(2.5 * 2**30) == "2.5 GiB"


def test_swap_files_are_charged_to_the_folder_each_goes_to_once(tmp_path, monkeypatch):
    """A JSON with the parameters' and the optimizer's NVMe folders apart (on one disk here) was charged the whole NVMe
    total at each (a walk's find, 2026-11-30): each folder now takes its own files, and on one disk they add up to it."""
    meta, ds, cfg, opts = _job(tmp_path, "ds_configs/zero3_nvme.json", nvme_path=str(tmp_path))
    zero = ds["zero_optimization"]
    (tmp_path / "params").mkdir(), (tmp_path / "states").mkdir()
    zero["offload_param"]["nvme_path"], zero["offload_optimizer"]["nvme_path"] = str(tmp_path / "params"), str(tmp_path / "states")
    counted = {}
    monkeypatch.setattr(preflight, "disk_needs", lambda writes, machine: counted.update(writes) or [])
    monkeypatch.setattr(preflight, "this_machine", lambda paths: preflight.Machine(host=1e15))
    preflight.check_elsa(meta, ds, cfg, opts, world=1)
    e = alternatives.Run(meta, ds, cfg, "zero3_nvme", "cpu", 1, 1).estimate()
    assert counted[tmp_path / "params"] == e.breakdown["params"]["nvme"] > 0
    assert counted[tmp_path / "params"] + counted[tmp_path / "states"] == pytest.approx(e.nvme_bytes)


def test_the_exports_bytes_follow_the_engines_dtype_fp16_included():
    shape = model_shape(resolve_model_config("google/gemma-2-2b"))
    sizes = {name: preflight.ds_bytes_export(shape, ds) for name, ds in
             {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}.items()}
    assert sizes == {"fp32": 4 * shape.num_params, "bf16": 2 * shape.num_params, "fp16": 2 * shape.num_params}


def test_host_memory_is_refused_past_what_there_is_gpu_memory_past_its_band():
    """Host memory running out is the kernel's silent kill: refused once the estimate exceeds it. GPU memory running out
    is CUDA's own error: refused only when even a 15 % high estimate would not fit, else a warning."""
    host = preflight.Need("host memory", 1.03 * GIB, GIB)
    gpu = preflight.Need("GPU memory", 1.03 * GIB, GIB, slack=preflight.MARGIN)
    assert host.refused and not gpu.refused and gpu.tight
    assert preflight.Need("GPU memory", 1.2 * GIB, GIB, slack=preflight.MARGIN).refused
    assert not preflight.Need("host memory", 0.99 * GIB, GIB).refused and preflight.Need("host memory", 0.99 * GIB, GIB).tight


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_the_sparse_exports_room_bounds_what_compress_writes(tmp_path, sparsity):
    """--export_format sparse builds the elsa-sparse checkpoint beside the dense export: the pre-flight counts its bytes
    as the bitmask code's, an upper bound, held here to what compress writes for the demo model pruned per layer."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from elsa_ds.sparse.compress import compress
    from tests.sparse.conftest import pruned_demo

    pruned = pruned_demo(tmp_path / "pruned", sparsity)
    compress(pruned, tmp_path / "sparse")
    written = sum(f.stat().st_size for f in (tmp_path / "sparse").glob("*.safetensors"))
    shape = model_shape(AutoConfig.from_pretrained(pruned))
    cfg = SimpleNamespace(sparsity=sparsity, sparsity_profile=None)
    bound = preflight.sparse_export_bytes(shape, 4, cfg, "sparse")
    assert written <= bound <= 1.1 * written + preflight.HEADER_ROOM, (written, bound)
    assert preflight.sparse_export_bytes(shape, 4, cfg, "dense") == 0
    profiled = preflight.sparse_export_bytes(shape, 4, SimpleNamespace(sparsity=sparsity, sparsity_profile="p"), "sparse")
    assert profiled == 4 * shape.num_params + preflight.HEADER_ROOM  # no sparsity assumed: the dense bytes


def _cgroup_tree(root, v1: bool, levels: list[tuple[int, int, int]]):
    """A copy of /proc/self/cgroup and the memory cgroup files it leads to: (limit, usage, inactive cache) per level, the
    job's own first, each level's folder inside the next one's."""
    names = [f"level{i}" for i in range(len(levels))][::-1]  # outermost first on the path
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(("4:memory:/" if v1 else "0::/") + "/".join(names) + "\n")
    base = root / ("sys/fs/cgroup/memory" if v1 else "sys/fs/cgroup")
    limit_name, usage_name, (active_key, inactive_key) = procfs.V1_FILES if v1 else procfs.V2_FILES
    for depth, (limit, usage, cache) in enumerate(levels[::-1]):
        folder = base.joinpath(*names[:depth + 1])
        folder.mkdir(parents=True)
        (folder / limit_name).write_text(f"{limit}\n")
        (folder / usage_name).write_text(f"{usage}\n")
        (folder / "memory.stat").write_text(f"anon 5\n{active_key} {cache // 2}\n{inactive_key} {cache - cache // 2}\nfile {cache}\n")
    return root


@pytest.mark.parametrize("v1", [True, False], ids=["cgroup_v1", "cgroup_v2"])
def test_the_room_a_cgroup_leaves_is_its_tightest_levels_limit_less_what_cannot_be_reclaimed(tmp_path, v1):
    """A SLURM allocation or a container caps the job below the node's free memory (psutil sees the node's): the
    check takes, of every level up the job's cgroup tree, its limit less its usage less its file page cache (active and
    inactive: the kernel reclaims both before it kills)."""
    root = _cgroup_tree(tmp_path, v1, [(8 * GIB, 3 * GIB, GIB), (10 * GIB, 5 * GIB, 0)])  # job: 6 GiB left, parent: 5
    assert procfs.cgroup_room(root) == (5 * GIB, 10 * GIB) and procfs.cgroup_limit(root) == 8 * GIB
    root = _cgroup_tree(tmp_path / "b", v1, [(8 * GIB, 3 * GIB, GIB), (64 * GIB, 5 * GIB, 0)])
    assert procfs.cgroup_room(root) == (6 * GIB, 8 * GIB)
    max((tmp_path / "b").rglob("memory.stat"), key=lambda f: len(f.parts)).unlink()  # the job's: its whole usage counts
    assert procfs.cgroup_room(root) == (5 * GIB, 8 * GIB)
    (tmp_path / "c/proc/self").mkdir(parents=True)
    (tmp_path / "c/proc/self/cgroup").write_text("0::/\n")
    assert procfs.cgroup_room(tmp_path / "c") is None  # no limit anywhere
    need = preflight.Need("host memory", 7 * GIB, 6 * GIB, limit=8 * GIB)
    assert need.refused and "this job's cgroup lets it take 6.0 GiB (its memory limit 8.0 GiB: SLURM's --mem" in need.line()


@pytest.mark.parametrize("v1", [True, False], ids=["cgroup_v1", "cgroup_v2"])
def test_the_cpus_a_job_may_use_are_its_affinity_and_its_cgroups_quota(tmp_path, v1):
    """The time hint's host profile was picked by os.cpu_count(), the machine's: a SLURM job of 16 CPUs on a 224-core
    server was timed as the whole server. The CPUs it may use: its affinity, and a cgroup's CPU quota (a container's
    --cpus) where that is smaller, at any level up the tree."""
    import os
    import subprocess
    import sys

    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(("3:cpu,cpuacct:/" if v1 else "0::/") + "job\n")
    base = tmp_path / "sys/fs/cgroup" / ("cpu,cpuacct" if v1 else "")
    (base / "job").mkdir(parents=True)
    for folder, quota in ((base, None), (base / "job", 150000)):
        if v1:
            (folder / "cpu.cfs_quota_us").write_text(f"{quota or -1}\n")
            (folder / "cpu.cfs_period_us").write_text("100000\n")
        else:
            (folder / "cpu.max").write_text(f"{quota or 'max'} 100000\n")
    affinity = len(os.sched_getaffinity(0))
    assert procfs.usable_cpus(tmp_path) == min(1.5, affinity)
    (base / "job" / ("cpu.cfs_quota_us" if v1 else "cpu.max")).write_text("-1\n" if v1 else "max 100000\n")
    assert procfs.usable_cpus(tmp_path) == affinity
    def pinned(**env: str) -> float:  # a child of this process bound to one of its CPUs
        run = subprocess.run([sys.executable, "-c", "from elsa_ds.files.procfs import usable_cpus; print(usable_cpus())"],
                             capture_output=True, text=True, env={**os.environ, **env},
                             preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
        return float(run.stdout.strip() or "nan")

    mine = procfs.usable_cpus()  # this process's affinity and its cgroup's quota (a CI container's may be below 1)
    assert pinned() == min(1.0, mine)
    # a rank under a launcher of several ranks counts its launcher's allocation (here: this process's), not its own cores
    assert pinned(LOCAL_RANK="0", WORLD_SIZE="2") == mine


def _limited_cgroup(limit: int):
    """A child of this process's memory cgroup (v1, as this box has) limited to ``limit`` bytes; None where it cannot be
    made (no cgroup v1 memory controller, or not allowed)."""
    import contextlib
    import uuid

    from pathlib import Path

    with contextlib.suppress(OSError, ValueError, StopIteration):
        own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if "memory" in line.split(":")[1].split(","))
        child = Path("/sys/fs/cgroup/memory") / own.lstrip("/") / f"elsa_test_{uuid.uuid4().hex[:8]}"
        child.mkdir()
        try:
            (child / "memory.limit_in_bytes").write_text(str(limit))
        except OSError:
            child.rmdir()
            raise
        return child
    return None


def test_a_job_in_a_cgroup_smaller_than_it_is_refused_where_the_node_would_fit_it(tmp_path):
    """The walk's SLURM case (2026-11-30): psutil reports the node's available memory, so a job in an allocation too small
    for it started and was killed by the kernel, silently. Run inside a real cgroup limited to 3 GiB, a job the node has
    room for but the cgroup has not is refused in one line that names the cgroup's limit."""
    import os
    import subprocess
    import sys

    import psutil

    from tests.conftest import ROOT

    limit = 3 * GIB
    model = _too_large_model(tmp_path / "model", 2 * GIB)  # ~4 GiB and more with CPU offload
    cgroup = _limited_cgroup(limit)
    if cgroup is None:
        pytest.skip("no writable cgroup v1 memory controller here")
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, str(ROOT / "launch" / "prune.py"), "--deepspeed", "ds_configs/zero3_offload.json",
                               "--model", str(model), "--random_init", "--dataset", "shakespeare", "--output_dir", str(tmp_path / "out")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                              preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        cgroup.rmdir()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "host memory" in errors[0] and "this job's cgroup lets it take" in errors[0] and "its memory limit 3.0 GiB" in errors[0]
    need = float(errors[0].split("needs ~")[1].split(" GiB")[0].replace(",", "")) * GIB
    assert need < psutil.virtual_memory().available, "the node alone would have let it start"
    assert not (tmp_path / "out").exists()


def test_a_one_shot_job_short_of_disk_is_told_of_disk_and_an_nvme_folder_of_creating_it(tmp_path, monkeypatch):
    """A walk: the one-shot's disk refusal advised ELSA and more memory, and a missing --nvme_path folder was named twice,
    each time with "or pass --nvme_path DIR" although it had been passed."""
    cfg = resolve_config({}, {"model": str(DEMO_MODEL_DIR), "method": "magnitude", "seqlen": 64})
    opts = JobOptions(deepspeed="zero3_offload", output_dir=tmp_path / "out")
    shape = model_shape(meta_model(resolve_model_config(str(DEMO_MODEL_DIR))).config)
    real = preflight.this_machine
    monkeypatch.setattr(preflight, "this_machine", lambda paths: preflight.Machine(
        host=1e15, disks={dev: 1e3 for dev in real(paths).disks}))
    with pytest.raises(ElsaError) as err:
        preflight.check_oneshot(shape, cfg, opts, 4)
    assert "disk at" in str(err.value) and "free space there or choose another --output_dir" in str(err.value)
    assert "more memory" not in str(err.value) and "--method elsa" not in str(err.value)
    nvme = resolve_config(DsConfig.load("zero3_nvme").raw, {"model": str(DEMO_MODEL_DIR), "nvme_path": str(tmp_path / "no")})
    problems = DsConfig.load("zero3_nvme").problems(nvme, 1, 64)
    said = [p for p in problems if "does not exist" in p]
    assert said == [f"NVMe path {tmp_path / 'no'} (--nvme_path) does not exist or is not a directory; create it"]


def test_a_job_too_large_is_told_of_memory_before_a_hub_dataset_it_cannot_fetch(tmp_path):
    """A walk (2026-12-04): offline, a job too large for this host with the default dataset (c4) was told to download c4
    first, then, once it had, that it could not fit. Memory is now checked before the texts."""
    import psutil

    model = _too_large_model(tmp_path / "model", psutil.virtual_memory().total)
    args = ["--deepspeed", "ds_configs/zero3_offload.json", "--model", str(model), "--random_init", "--output_dir", str(tmp_path / "out")]
    proc = run_entry("prune.py", args, check=False, timeout=300, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1 and "host memory" in errors[0], proc.stderr[-3000:]
    assert "c4" not in errors[0] and not (tmp_path / "out").exists()  # a job that fits is told of c4: test_prune_errors


def test_a_one_shot_refusal_sized_by_the_validation_windows_says_so(tmp_path):
    """An audit (2026-12-07): --val_windows 100000 was refused for ~98 GiB with only "prune with ELSA ... or a machine with
    more memory" to do, while the text gave 259 windows and the job ran in a minute. The refusal names the setting."""
    from tests.conftest import run_fails

    line = run_fails("prune.py", ["--deepspeed", "zero3_offload", "--method", "magnitude", "--val_windows", "1000000",
                                  "--seqlen", "512", "--output_dir", str(tmp_path / "out")], "host memory", "--val_windows 1000000 adds")  # ~1 TB: refused anywhere
    assert "lower it" in line and not (tmp_path / "out").exists()
