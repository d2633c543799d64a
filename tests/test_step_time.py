"""elsa-estimate's time: a step's components follow the bytes and FLOPs the configs imply, the machine's rates come from
a measurement or a named typical host, and the whole run's hours are printed (and in --json) offline, in seconds."""
from __future__ import annotations

import json
import math
import time

import pytest
from transformers import AutoConfig

from elsa_ds.capacity.memory import model_shape
from elsa_ds.capacity.step_time import TYPICAL, measure, step_time
from elsa_ds.cli import main_estimate
from elsa_ds.models import SHIPPED_CONFIGS
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.zero.ds_config import DsConfig

GEMMA2_27B = json.loads((SHIPPED_CONFIGS / "google/gemma-2-27b/config.json").read_text())


def _timed(layers: int = 4, deepspeed: str = "zero3_offload", num_gpus: int = 1, num_nodes: int = 1, device: str = "cuda",
           machine: str = "gpu-vm-16c", freeze: bool = True, **settings):
    shape = model_shape(AutoConfig.for_model(**{**GEMMA2_27B, "num_hidden_layers": layers}), freeze_embeddings=freeze)
    world = num_gpus * num_nodes
    ds = {**DsConfig.load(deepspeed).raw, "train_batch_size": settings.pop("batch", world), "train_micro_batch_size_per_gpu": 1}
    cfg = ElsaConfig(model="m", seqlen=2048, **{**ds.get("elsa", {}), **settings})  # the JSON's block, as the job reads it
    return step_time(shape, ds, cfg, num_gpus, num_nodes, device, TYPICAL[machine]), shape


def test_the_step_is_the_sum_of_its_components_and_the_run_adds_what_steps_do_not():
    t, _ = _timed(steps=100)
    assert t.step_s == pytest.approx(sum(t.components.values()))
    assert t.run_parts["steps"] == pytest.approx(100 * t.step_s)
    assert t.run_s == pytest.approx(sum(t.run_parts.values())) and t.run_s > t.run_parts["steps"]
    assert t.components["nvme"] == 0 and all(v > 0 for k, v in t.components.items() if k != "nvme")


def test_the_run_names_the_end_of_run_evaluation_it_leaves_out():
    """A 4-step job with --eval_ppl spent ~300 s on it beyond the run's hours, which named only the warm start (a user's
    walk, 2026-11-30): the time it leaves out names the evaluation when the job has one."""
    plain, _ = _timed(steps=100)
    evaluated, _ = _timed(steps=100, eval_ppl=["wikitext2"])
    assert not any("evaluation" in part for part in plain.uncounted)
    assert "the end-of-run evaluation (--eval_ppl, --eval_tasks)" in evaluated.uncounted


def test_selection_adds_a_validation_pass_for_each_projection_it_scores():
    """--select_every 1 doubled a demo run's wall time while its expected time stayed the same (an audit, 2026-12-07):
    each scored projection is one more pass over the validation windows."""
    plain, _ = _timed(steps=100, interval=10)
    scored, _ = _timed(steps=100, interval=10, select_every=3)
    assert plain.run_parts["selection"] == 0
    assert scored.run_parts["selection"] == pytest.approx(scored.run_parts["validation"])  # (99 // 10) // 3 passes, as its 3
    assert scored.run_s - plain.run_s == pytest.approx(scored.run_parts["selection"])


def test_checkpoints_add_their_writes_to_the_run():
    """--save_interval's checkpoints were not in the run's hours (Gemma-2-27B at 256: 15 saves of 507 GiB, ~27 min on a
    typical server's disk). Each save writes one checkpoint's bytes, a node its ranks' share; the last step saves none."""
    from elsa_ds.capacity.resident import checkpoint_tag_bytes, element_bytes

    plain, shape = _timed(steps=100)
    saved, _ = _timed(steps=100, save_interval=25)
    two_nodes, _ = _timed(steps=100, save_interval=25, num_gpus=1, num_nodes=2, batch=2)
    cfg = ElsaConfig(model="m", seqlen=2048, steps=100, save_interval=25)
    assert plain.run_parts["checkpoints"] == 0
    each = checkpoint_tag_bytes(shape, cfg, element_bytes(DsConfig.load("zero3_offload").raw))  # the frozen embedding in bf16
    assert saved.run_parts["checkpoints"] == pytest.approx(3 * each / TYPICAL["gpu-vm-16c"].disk)
    assert saved.run_s - plain.run_s == pytest.approx(saved.run_parts["checkpoints"])
    assert two_nodes.run_parts["checkpoints"] == pytest.approx(saved.run_parts["checkpoints"] / 2)


def test_a_job_allowed_part_of_a_server_gets_that_parts_cpu_rates_and_the_servers_others():
    """Under SLURM's --cpus-per-task 32 an 8-GPU server's job was timed as the 16-core VM (one NVMe drive, its host copy
    rate: 28.5 h for zero3_offload where the server's profile says 17.4; a review's find). The server's profile stays;
    its CPU-bound rates (DeepSpeedCPUAdam, the host's copies) are at most the lent 16-core host's per CPU."""
    from elsa_ds.capacity.step_time import LENT_HOST_CPUS, allotted

    server, lent = TYPICAL["gpu-server"], TYPICAL["gpu-vm-16c"]
    assert allotted(server, 224) is server and allotted(lent, 16) is lent  # the whole machine: its own rates
    part = allotted(server, 32)
    assert part.adam == pytest.approx(32 * lent.adam / LENT_HOST_CPUS) and part.adam < server.adam and part.host_bw < server.host_bw
    assert (part.nvme, part.h2d, part.inter, part.matmul_flops) == (server.nvme, server.h2d, server.inter, server.matmul_flops)
    assert "for the 32 CPUs allowed" in part.source
    whole, _ = _timed(machine="gpu-server", steps=100)
    shape = _timed(steps=100)[1]
    ds = {**DsConfig.load("zero3_offload").raw, "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}
    cfg = ElsaConfig(model="m", seqlen=2048, steps=100)
    cut = step_time(shape, ds, cfg, 1, 1, "cuda", part)
    assert cut.components["optimizer"] > whole.components["optimizer"]
    assert cut.components["forward/backward"] == pytest.approx(whole.components["forward/backward"])


def test_host_work_follows_the_trained_entries_and_the_projection_its_interval():
    frozen, shape = _timed(interval=8)
    trained, shape_all = _timed(interval=8, freeze=False)
    ratio = shape_all.trainable_params / shape.trainable_params
    for name in ("optimizer", "host passes", "projection"):
        assert trained.components[name] == pytest.approx(ratio * frozen.components[name])
    sparse_projection, _ = _timed(interval=32)
    assert sparse_projection.components["projection"] == pytest.approx(frozen.components["projection"] / 4)
    assert sparse_projection.components["optimizer"] == frozen.components["optimizer"]


def test_elsal_and_its_kernel_cost_and_nvme_traffic():
    fp32, _ = _timed()
    elsal, _ = _timed(deepspeed="zero3_offload_elsal")
    assert elsal.components["optimizer"] / fp32.components["optimizer"] == pytest.approx(
        TYPICAL["gpu-vm-16c"].kernel["adam8bit_minifloat"] / TYPICAL["gpu-vm-16c"].kernel["cpu_adam"])
    nvme, _ = _timed(deepspeed="zero3_nvme", nvme_path="/tmp")
    assert nvme.components["nvme"] > 0 and nvme.step_s > fp32.step_s


@pytest.mark.parametrize("elsal", [False, True])
def test_nvme_traffic_is_what_the_memory_estimate_puts_on_nvme_read_and_written_once_a_step(elsal):
    """A user's walk (2026-12-01): the time left out the fp32 gradients the memory table puts on NVMe, and swapped
    ELSA-L's 8-bit moments and fp8/bf16 z, u, which the table keeps in host memory. Parameters in memory here, so that
    the NVMe traffic is the optimizer's alone: each byte on NVMe moved twice a step."""
    from elsa_ds.capacity.memory import estimate

    settings = {"z_dtype": "fp8", "u_dtype": "bf16", "base_optimizer": "adam8bit_minifloat"} if elsal else {}
    ds = DsConfig.load("zero3_nvme").raw
    ds = {**ds, "zero_optimization": {**ds["zero_optimization"], "offload_param": {"device": "cpu"}},
          "train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}
    shape = model_shape(AutoConfig.for_model(**{**GEMMA2_27B, "num_hidden_layers": 4}), freeze_embeddings=True)
    cfg = ElsaConfig(model="m", seqlen=2048, nvme_path="/tmp", **settings)
    t = step_time(shape, ds, cfg, 8, 1, "cuda", TYPICAL["gpu-server"])
    rows = estimate(shape, ds, 8, 1, 2048, elsa=cfg.model_dump(mode="json"), device="cuda").breakdown
    on_nvme = {row: rows[row]["nvme"] for row in ("grads", "optimizer", "admm")}
    assert on_nvme["grads"] > 0 and (on_nvme["admm"] == 0) == elsal  # ELSA-L's z, u stay in host memory
    assert t.components["nvme"] == pytest.approx(2 * sum(on_nvme.values()) / TYPICAL["gpu-server"].nvme)


def test_the_remedies_eager_parts_cost_what_the_bench_measured_against_the_fused_step():
    """--lmda_schedule adaptive steps and updates z, u on the eager path, --relaxation only updates them there: each
    costs its measured factor (bench/optimizer_step.py --remedies) over the fused figures, on ELSA-L's base too."""
    from elsa_ds.capacity.step_time import REMEDY_FACTORS

    for deepspeed, base in (("zero3_offload", "cpu_adam"), ("zero3_offload_elsal", "adam8bit_minifloat")):
        fused, _ = _timed(deepspeed=deepspeed)
        for remedy, settings in (("adaptive", {"lmda_schedule": "adaptive"}), ("relaxed", {"relaxation": 1.6})):
            t, _ = _timed(deepspeed=deepspeed, **settings)
            step, projection = REMEDY_FACTORS[remedy][base]
            assert t.components["optimizer"] == pytest.approx(step * fused.components["optimizer"]), (remedy, base)
            assert t.components["projection"] == pytest.approx(projection * fused.components["projection"]), (remedy, base)
            assert t.components["forward/backward"] == fused.components["forward/backward"] and t.step_s > fused.step_s
            assert t.run_parts["first projection"] == fused.run_parts["first projection"]  # z₀ = Π(x): fused with either
        assert REMEDY_FACTORS["relaxed"][base][0] == 1.0  # its x-step stays fused
    on_gpu, _ = _timed(deepspeed="zero3")           # the optimizer on the GPU: eager there already, nothing to scale
    assert _timed(deepspeed="zero3", lmda_schedule="adaptive")[0].components == on_gpu.components


def test_more_ranks_share_the_host_and_a_second_node_halves_its_share():
    one, _ = _timed(num_gpus=1)
    eight, _ = _timed(num_gpus=8, machine="gpu-server")
    sixteen, _ = _timed(num_gpus=8, num_nodes=2, machine="gpu-server")
    # 8 ranks on a node: each steps 1/8 of the entries but shares the node's host with 7 others
    assert eight.components["optimizer"] == pytest.approx(
        one.components["optimizer"] * TYPICAL["gpu-vm-16c"].adam / TYPICAL["gpu-server"].adam)
    assert sixteen.components["optimizer"] == pytest.approx(eight.components["optimizer"] / 2)
    assert sixteen.components["forward/backward"] > 0


def test_the_optimizer_on_the_gpu_leaves_no_host_pass_and_a_cpu_job_no_pcie():
    gpu, _ = _timed(deepspeed="zero3")
    assert gpu.components["host passes"] == 0 and gpu.components["optimizer"] < 0.1
    cpu, _ = _timed(layers=1, device="cpu", machine="cpu-2c", num_gpus=2)
    assert cpu.components["forward/backward"] > gpu.components["forward/backward"]  # 2 cores against an H100


def test_measure_times_this_machine_in_seconds():
    t0 = time.perf_counter()
    rates = measure("cpu", TYPICAL["cpu-2c"], 32)
    assert time.perf_counter() - t0 < 60
    assert rates.source.startswith("measured on this machine")
    for name in ("matmul_flops", "host_bw", "adam", "device_bw"):
        value = getattr(rates, name)
        assert math.isfinite(value) and value > 0, name
    assert rates.adam != TYPICAL["cpu-2c"].adam  # DeepSpeedCPUAdam ran here


def test_the_mission_case_prints_memory_and_hours_offline_in_seconds(capsys):
    t0 = time.perf_counter()
    assert main_estimate(["--model", "google/gemma-2-27b", "--deepspeed", "zero3_offload_elsal", "--num_gpus", "8",
                          "--seqlen", "2048", "--batch_size", "64", "--micro_batch", "1", "--steps", "4096", "--json"]) == 0
    assert time.perf_counter() - t0 < 30
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("time per step") for line in out)
    assert any(line.startswith("the run: 4096 steps") and " h (" in line for line in out)
    last = json.loads(out[-1])
    assert last["per_node_cpu_bytes"] > 0 and last["time"]["steps"] == 4096
    assert last["time"]["run_s"] > 4096 * last["time"]["step_s"] * 0.99
    assert last["time"]["rates"]["source"].startswith("typical 8-GPU server")
    # a remedy is a setting the estimate reads as elsa-prune does: the same command with it takes longer
    assert main_estimate(["--model", "google/gemma-2-27b", "--deepspeed", "zero3_offload_elsal", "--num_gpus", "8", "--seqlen",
                          "2048", "--batch_size", "64", "--micro_batch", "1", "--steps", "4096", "--lmda_schedule", "adaptive",
                          "--json"]) == 0
    adaptive = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert adaptive["time"]["run_s"] > 2 * last["time"]["run_s"]


def test_the_reports_mean_counts_the_projections_in_the_steps_it_averages():
    t, _ = _timed(steps=8, interval=4)
    plain, each = t.step_s - t.components["projection"], t.components["projection"] * 4
    assert t.report_mean() == pytest.approx(plain + each * 2 / 7)  # steps 1..7: step 3 projects, step 7 finalizes
    long, _ = _timed(steps=4096, interval=32)
    assert long.report_mean() == pytest.approx(long.step_s, rel=1e-3)


def test_leaf_layers_price_one_hook_pair_a_decoder_layer_instead_of_one_a_tensor():
    """--leaf_layers: ZeRO-3 fetches each decoder layer whole, so the hooks' time counts layers, not the tensors inside
    them; nothing else in the step changes."""
    plain, shape = _timed(layers=4)
    leaf, _ = _timed(layers=4, leaf_layers=True)
    hook_s = TYPICAL["gpu-vm-16c"].hook_s
    assert shape.layer_tensors > shape.layers == 4
    saved = plain.components["forward/backward"] - leaf.components["forward/backward"]
    assert saved == pytest.approx(2 * (shape.layer_tensors - shape.layers) * hook_s)
    assert {k: v for k, v in leaf.components.items() if k != "forward/backward"} == \
        {k: v for k, v in plain.components.items() if k != "forward/backward"}


def test_the_json_says_the_nodes_and_each_nodes_nvme_beside_the_jobs(capsys):
    """A user's walk (2026-12-01): nvme_bytes is the whole job's while per_node_cpu_bytes is a node's, and the JSON had no
    node count to convert it: it now carries both, and the table's per-node NVMe is the JSON's."""
    assert main_estimate(["--model", "google/gemma-2-27b", "--deepspeed", "zero3_nvme", "--num_gpus", "8", "--num_nodes", "2",
                          "--batch_size", "128", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert (last["num_gpus"], last["num_nodes"], last["world_size"]) == (8, 2, 16)
    assert last["per_node_nvme_bytes"] == pytest.approx(last["nvme_bytes"] / 2) and last["nvme_bytes"] > 0
    total = next(line for line in out if line.startswith("total"))
    assert total.split()[-2] == f"{last['per_node_nvme_bytes'] / 2**30:.2f}"
    # each row's per-node NVMe is the table's column (its "nvme" stays the job's)
    rows = {line.split()[0]: line.split()[-2] for line in out if line.split() and line.split()[0] in last["breakdown"]}
    assert rows and all(rows[k] == f"{v['per_node_nvme'] / 2**30:.2f}" for k, v in last["breakdown"].items() if k in rows)
    assert sum(v["per_node_nvme"] for v in last["breakdown"].values()) == pytest.approx(last["per_node_nvme_bytes"])
    assert any(v["per_node_nvme"] > 0 and v["nvme"] == pytest.approx(2 * v["per_node_nvme"]) for v in last["breakdown"].values())


def test_a_gpu_resident_projection_costs_what_the_h100_measured_against_elsas_step():
    """A user's walk (2026-12-01): the projection of a flat on the GPU was priced at the host kernels' ~2.7 passes over
    its bytes; the H100 measured the eager torch projection at 26.0 ms against ELSA's 0.77 ms step (34x) on a 32M flat."""
    t, _ = _timed(deepspeed="zero3", num_gpus=8, batch=8)
    first, step = t.run_parts["first projection"], t.components["optimizer"]
    assert 25 < first / step < 45
    assert t.components["projection"] == pytest.approx(first / t.interval)


def test_torchs_adam_on_the_host_is_priced_as_measured_not_as_the_fused_kernel():
    """A user's walk (2026-12-01): --base_optimizer adam under CPU offload added 53 GiB of workspace to the estimate but
    nothing to the step, priced as DeepSpeedCPUAdam's fused kernel; ELSA on torch's Adam took 8.3-8.8 of its steps."""
    fused, _ = _timed()
    torch_adam, _ = _timed(base_optimizer="adam")
    ratio = torch_adam.components["optimizer"] / fused.components["optimizer"]
    assert ratio == pytest.approx(8.55 / TYPICAL["gpu-vm-16c"].kernel["cpu_adam"])
    assert torch_adam.step_s > fused.step_s + 2 * fused.components["optimizer"]
