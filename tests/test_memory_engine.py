"""The estimate's rows against the bytes the real DeepSpeed engine allocates: one ELSA step of a small Gemma-2 on 1 rank
(DeepSpeed's CPU accelerator, ``tests/memory_probe.py`` in a process of its own), each row held to the engine's tensors,
and on a GPU host the pinned buffers as torch's caching host allocator holds the ones DeepSpeed pinned here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elsa_ds.capacity.memory import estimate, model_shape
from elsa_ds.capacity.resident import pinned_events, pinned_reserved, read_job, sub_groups
from elsa_ds.models import load_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration
# (site of the pin_memory call, row): zero.Init's per-parameter partitions and the engine's flat 16-bit buffer are the
# params row's; a sub-group's fp32 gradient and the flat gradient accumulation buffer the grads row's
ROWS = {"_partition_param": "params", "_create_param_groups_fp16_flat_cpu_memory": "params",
        "initialize_optimizer_states": "grads", "_setup_for_real_optimizer": "grads"}


@pytest.fixture(scope="module")
def probe_model(tmp_path_factory) -> Path:
    """558K parameters, tied embedding: four sub-groups of ~150K entries with the probe's sub_group_size."""
    from transformers import Gemma2Config

    d = tmp_path_factory.mktemp("probe_model")
    Gemma2Config(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, max_position_embeddings=256, sliding_window=64, pad_token_id=0,
                 eos_token_id=1, bos_token_id=2).save_pretrained(d)
    return d


def _probe(model: Path, config: str, freeze: bool, *extra: str) -> dict:
    # a fixed mmap threshold: freed tensors go back to the OS at once, so peak RSS follows live bytes, not heap history
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "memory_probe.py"), str(model), f"ds_configs/{config}.json",
                           *(["--freeze_embeddings"] if freeze else []), *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config, freeze", [("zero3_offload", False), pytest.param("zero3_offload_elsal", True, marks=pytest.mark.slow), ("zero3", True)])
def test_each_row_is_the_bytes_the_engine_allocates(probe_model, config, freeze):
    real = _probe(probe_model, config, freeze)
    shape = model_shape(load_config(str(probe_model)), real["cfg"]["targets"], freeze_embeddings=freeze)
    ds, cfg = real["ds"], real["cfg"]
    est = estimate(shape, ds, 1, 1, cfg["seqlen"], elsa=cfg, device="cpu")  # DeepSpeed's CPU accelerator: the device is the host
    rows = {name: row["per_node_cpu"] for name, row in est.breakdown.items()}
    assert [g.numel for g in sub_groups(shape, 1, ds["zero_optimization"]["sub_group_size"])] == real["sub_groups"]
    # exact: 16-bit partitions (the engine's flat buffer, frozen ones where zero.Init put them); the bf16 gradient
    # accumulation buffer and, offloaded, one fp32 gradient per sub-group; the reduce bucket
    assert rows["params"] == real["params"]
    assert rows["grads"] == real["grads"]
    assert rows["buffers"] == real["buffers"]
    # per entry exact; per flat the estimate leaves out constants: the step counter (4 B), z's and u's scale per layer
    # (4 B each), 8-bit Adam's two code maps (1 KiB each) and its last absmax block's rounding
    slack = 4096 * len(real["sub_groups"])
    assert 0 <= real["masters"] + real["moments"] - rows["optimizer"] <= slack, (real["masters"], real["moments"], rows["optimizer"])
    assert 0 <= real["admm"] - rows["admm"] <= slack, (real["admm"], rows["admm"])
    # the same job on a GPU host: what DeepSpeed pinned here, as torch's caching host allocator holds it
    gpu = estimate(shape, ds, 1, 1, cfg["seqlen"], elsa=cfg, device="cuda").breakdown
    job = read_job(shape, ds, cfg, 1, "cuda")
    modelled = pinned_events(shape, job, sub_groups(shape, 1, ds["zero_optimization"]["sub_group_size"]), 1e9)
    for row in ("params", "grads"):
        seen = [(kind, nbytes) for kind, nbytes, site in real["pins"] if ROWS[site] == row]
        assert sorted(seen) == sorted(modelled[row]), row  # the same tensors pinned and freed
        assert gpu[row]["per_node_cpu"] == pinned_reserved(seen), row  # offloaded, everything in the row is pinned


@pytest.mark.parametrize("config", ["zero3_offload", pytest.param("zero3_offload_elsal", marks=pytest.mark.slow)])
def test_the_fused_projection_needs_no_workspace_beyond_a_plain_step(tmp_path, config):
    """The estimate counts no projection workspace on CPU flats and ~1 byte per entry at the first step (``memory.py``):
    the fused kernels keep no score buffer. One 28M-entry sub-group, where the eager reference's 10N + 8S is ~350 MB."""
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=512, hidden_size=1024, intermediate_size=8192, num_hidden_layers=1, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=128, max_position_embeddings=256, sliding_window=64, pad_token_id=0,
                 eos_token_id=1, bos_token_id=2).save_pretrained(tmp_path)
    real = _probe(tmp_path, config, True, "--sub_group_size", "1e9")
    shape = model_shape(load_config(str(tmp_path)), freeze_embeddings=True)
    rows = estimate(shape, real["ds"], 1, 1, real["cfg"]["seqlen"], elsa=real["cfg"], device="cpu").breakdown
    (first, _), (projection, projected), (plain, plain_projected), (final, _) = real["step_growth"]
    assert projected and not plain_projected and real["sub_groups"] == [shape.trainable_params]
    eager = 10 * shape.pruned_params + 8 * shape.largest_pruned_param
    assert max(projection, final) - plain < 0.02 * eager, real["step_growth"]
    # the first step creates the moments and z, u; what it needs beyond them and a plain step's working set
    created = rows["optimizer"]["per_node_cpu"] - real["masters"] + rows["admm"]["per_node_cpu"]
    assert first - created - plain < 1.5 * shape.trainable_params, (first, created, plain)


@pytest.mark.parametrize("extra", [("--lmda_schedule", "adaptive"), pytest.param(("--relaxation", "1.6"), marks=pytest.mark.slow)])
def test_an_eager_update_stays_within_its_estimate(tmp_path, extra):
    """The adaptive λ and over-relaxation update z, u on the eager path even on CPU flats: the estimate counts its
    workspace (``resident.read_job``: not fused), and the engine's projection step grows by no more than that, one layer's
    temporaries at a time (a whole-flat copy of z or u would be 4N more). The same 28M-entry sub-group as above."""
    from transformers import Gemma2Config

    from elsa_ds.capacity.memory import _step_workspace

    Gemma2Config(vocab_size=512, hidden_size=1024, intermediate_size=8192, num_hidden_layers=1, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=128, max_position_embeddings=256, sliding_window=64, pad_token_id=0,
                 eos_token_id=1, bos_token_id=2).save_pretrained(tmp_path)
    real = _probe(tmp_path, "zero3_offload", True, "--sub_group_size", "1e9", *extra)
    shape = model_shape(load_config(str(tmp_path)), freeze_embeddings=True)
    job = read_job(shape, real["ds"], real["cfg"], 1, "cpu")
    (group,) = sub_groups(shape, 1, real["ds"]["zero_optimization"]["sub_group_size"])
    estimated = _step_workspace(group, job, False, 0.0, False, "projection")
    assert not job.fused and job.fused_init and estimated == 10 * group.pruned + 8 * group.largest_pruned
    (_, _), (projection, projected), (plain, plain_projected), (final, _) = real["step_growth"]
    assert projected and not plain_projected and (real["cfg"]["lmda_schedule"], real["cfg"]["relaxation"]) != ("constant", 1.0)
    assert 0.25 * estimated < projection - plain <= estimated, (projection - plain, estimated)


def test_a_small_model_stays_gathered_from_its_forward_to_its_backward_as_estimated(tmp_path):
    """From the second step ZeRO-3 keeps gathered what its trace says is used again within stage3_max_reuse_distance
    entries: the shipped 1e9 keeps a model of 2.0 M entries (eight decoder layers, every tensor partitioned) whole from
    its forward to its backward, read from the engine when the model's forward ends; the estimate's gathered entries
    (``memory.gathered_params``) say so (the two layers in flight alone are a quarter of it)."""
    from transformers import Gemma2Config

    from elsa_ds.capacity.memory import gathered_params

    Gemma2Config(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=8, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, max_position_embeddings=256, sliding_window=64, pad_token_id=0,
                 eos_token_id=1, bos_token_id=2).save_pretrained(tmp_path)
    real = _probe(tmp_path, "zero3", False, "--persistence", "0")
    shape = model_shape(load_config(str(tmp_path)))
    first, *later = real["gathered_after_forward"]
    assert real["num_params"] == shape.num_params and real["ds"]["zero_optimization"]["stage3_max_reuse_distance"] == 1e9
    assert first < shape.num_params and later == [shape.num_params] * 3  # the first step traces and releases
    assert gathered_params(shape, real["ds"]["zero_optimization"], False, "cpu") == shape.num_params
