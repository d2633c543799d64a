"""--leaf_layers: ZeRO-3 hooks each decoder layer whole (DeepSpeed's leaf modules), so a step of a model with many small
modules spends less host time in hooks; the computation is the same, to float rounding."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, derived_config, run_entry, run_fails


def partitioned_config(tmp_path, base: str):
    """A shipped config with every parameter partitioned, none persistent: the test model's tensors are below the
    shipped 1e5-entry persistence threshold, so with it nothing inside a layer would ever be fetched or released."""
    zero = json.loads((ROOT / "ds_configs" / base).read_text())["zero_optimization"]
    return derived_config(tmp_path, base, bf16={"enabled": False},
                          zero_optimization={**zero, "stage3_param_persistence_threshold": 0})


HOOKS = """
import json, sys
import deepspeed, torch
from deepspeed.runtime.zero.linear import zero3_linear_wrap
from elsa_ds.models import ModelSource
from elsa_ds.targets import decoder_layer_list
from elsa_ds.zero import compat
from elsa_ds.zero.dist import init_distributed
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import load_partitioned

init_distributed()
ds = DsConfig(json.loads(sys.argv[2]))
found = {}
for leaf in (False, True):
    torch.manual_seed(0)
    # the leaf run's JSON turns DeepSpeed's linear wrapper off (as the budget curve's does)
    run = DsConfig({**ds.raw, "zero_optimization": {**ds.zero, "memory_efficient_linear": not leaf}})
    model = load_partitioned(ModelSource(sys.argv[1]), run, random_init=True, leaf_layers=leaf).model.train()
    wrapped = torch.nn.functional.linear is zero3_linear_wrap  # the plain run's zero.Init replaced it for the whole process
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), config=run.raw)
    layers = decoder_layer_list(model)
    inside = [m for layer in layers for m in layer.modules() if m is not layer]
    ids = torch.randint(0, 512, (1, 16))
    losses = []
    for _ in range(2):  # every parameter partitioned (no persistence): fetched and released, whole layers or not
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    found[str(leaf)] = {"hooked_inside": sum(1 for m in inside if m._forward_pre_hooks), "inside": len(inside),
                        "leaves": len(compat.leaf_modules(model)), "layers": len(layers), "losses": losses, "wrapped": wrapped}
print(json.dumps(found), flush=True)
"""


def test_each_decoder_layer_is_hooked_whole_and_nothing_inside_it(tmp_path, tiny_model_dir):
    """The real engine, in a process of its own: without the flag DeepSpeed hooks the modules inside each decoder layer
    (projections, norms); with it, each layer is one leaf, nothing inside it is hooked, and two steps run alike."""
    ds = {**json.loads(partitioned_config(tmp_path, "zero3.json").read_text()), "train_batch_size": 1,
          "train_micro_batch_size_per_gpu": 1}
    proc = subprocess.run([sys.executable, "-c", HOOKS, str(tiny_model_dir), json.dumps(ds)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, leaf = found["False"], found["True"]
    assert plain["hooked_inside"] > 0 and plain["leaves"] == 0
    assert leaf["hooked_inside"] == 0 and leaf["leaves"] == leaf["layers"] == plain["layers"] > 0
    assert leaf["losses"] == pytest.approx(plain["losses"], rel=1e-5) and plain["losses"][1] != plain["losses"][0]
    # torch's F.linear where the JSON turns the wrapper off, though the plain run's zero.Init had replaced it process-wide
    assert plain["wrapped"] and not leaf["wrapped"]


def _runs(tmp_path, model, text, args: list[str], ranks: int | None) -> dict[bool, dict]:
    """The same job without and with --leaf_layers: {leaf: (weights, report)}."""
    cfg = partitioned_config(tmp_path, "zero3_offload.json")
    runs = {}
    for leaf in (False, True):
        out = tmp_path / f"out_{leaf}"
        run_entry("prune.py", ["--deepspeed", str(cfg), "--model", str(model), "--dataset", str(text), "--seqlen", "32",
                               "--lr", "1e-3", "--val_windows", "0", "--baseline", "none", *args,
                               *(["--leaf_layers"] if leaf else []), "--output_dir", str(out)], ranks=ranks)
        runs[leaf] = {"weights": load_file(out / "model.safetensors"), "report": json.loads((out / "elsa_report.json").read_text())}
        assert runs[leaf]["report"]["config"]["leaf_layers"] is leaf
    return runs


@pytest.mark.integration
@pytest.mark.parametrize("job", [["--method", "dense", "--finetune", "full"],
                                 ["--method", "dense", "--finetune", "full", "--freeze_embeddings"],
                                 ["--method", "magnitude", "--sparsity", "0.5", "--finetune", "lora"]],
                         ids=["dense", "frozen-embeddings", "lora"])
def test_retraining_with_leaf_layers_ends_at_the_same_weights(tmp_path, tiny_model_dir, text_dir, job):
    """Fine-tuning in fp32, no mask to amplify a difference: the same weights to float rounding (DeepSpeed reduces a
    leaf's gradients when its backward ends, not one by one: most entries ~1e-8 apart after 3 steps here, where bf16 runs
    matched bit for bit). With the embeddings frozen (and under LoRA, which freezes them) layer 0's input needs no
    gradient, and its leaf's reduction hook would fire before the layer's backward: ``compat.mark_leaf_layers`` makes it
    need one.
    A layer whose gradients were lost would be ~lr apart everywhere."""
    runs = _runs(tmp_path, tiny_model_dir, text_dir, [*job, "--steps", "3", "--micro_batch", "8", "--no-gradient_checkpointing"],
                 ranks=None)
    plain, leaf = runs[False]["weights"], runs[True]["weights"]
    start = load_file(tiny_model_dir / "model.safetensors")
    apart = torch.cat([(leaf[n] - w).abs().flatten() for n, w in plain.items()])  # Adam's m / sqrt(v) can turn a rounding
    assert (apart <= 1e-6).float().mean() >= 0.999 and apart.max() < 1e-3    # of a ~0 gradient into up to lr: rarely
    for weights in (plain, leaf):  # both trained layer 0 (under LoRA: adapters merged into the pruned weights)
        assert all(not torch.equal(weights[n], start[n] * (weights[n] != 0))
                   for n in plain if ".layers.0." in n and n.endswith("proj.weight"))


@pytest.mark.integration
def test_elsa_with_leaf_layers_finds_the_same_masks(tmp_path, tiny_model_dir, text_dir):
    """ELSA on 2 ranks, the shipped CPU-offload config, gradient checkpointing (the recompute runs inside a leaf): the
    projections see weights a rounding apart, so only near-ties may flip: each layer's mask agrees on ≥ 99 % of entries."""
    runs = _runs(tmp_path, tiny_model_dir, text_dir, ["--steps", "6", "--interval", "2", "--sparsity", "0.7", "--micro_batch",
                                                      "2", "--init_mask", "none", "--gradient_checkpointing"], ranks=2)
    layers = runs[False]["report"]["layers"]
    assert layers
    for name in layers:
        plain, leaf = runs[False]["weights"][name] != 0, runs[True]["weights"][name] != 0
        assert plain.sum() == leaf.sum()  # exact sparsity either way
        assert (plain == leaf).float().mean() >= 0.99, name
    assert runs[True]["report"]["final_loss"] == pytest.approx(runs[False]["report"]["final_loss"], rel=1e-3)


def test_leaf_layers_with_parameters_on_nvme_are_refused_before_any_work(tmp_path, tiny_model_dir):
    """DeepSpeed swaps each NVMe-offloaded parameter into one of offload_param.buffer_count buffers, and a leaf's fetch
    swaps a whole layer in at once: more tensors than the shipped 5 buffers. One line, exit 2, before the model loads."""
    (tmp_path / "nvme").mkdir()
    error = run_fails("prune.py", ["--deepspeed", "ds_configs/zero3_nvme.json", "--nvme_path", str(tmp_path / "nvme"),
                                   "--model", str(tiny_model_dir), "--seqlen", "32", "--leaf_layers", "--output_dir", str(tmp_path / "out")],
                      "--leaf_layers", "offload_param on NVMe", "zero3_offload")
    assert "buffer_count" in error and not (tmp_path / "out").exists()



def test_leaf_layers_leave_deepspeeds_linear_as_the_json_sets_it():
    """Torch's F.linear keeps every gathered weight until its backward (a view of it is saved), so it is the JSON's
    choice (memory_efficient_linear), never the flag's."""
    from elsa_ds.settings.config import DEMO_MODEL_DIR, resolve_config
    from elsa_ds.zero.ds_config import DsConfig

    view = DsConfig.load("zero3")
    for leaf in (False, True):
        cfg = resolve_config(view.raw, {"model": str(DEMO_MODEL_DIR), "leaf_layers": leaf})
        assert "memory_efficient_linear" not in view.engine_config(cfg, 1)["zero_optimization"]
