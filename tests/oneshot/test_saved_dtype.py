"""What a one-shot job writes its model in: the DeepSpeed config's bf16 (as an ELSA job with that config exports), else
the host copy's dtype; the pruned perplexity is taken on the weights rounded as they are saved (zeros kept)."""
from __future__ import annotations

import torch

from elsa_ds.oneshot.pipeline import host_dtype, round_to, saved_dtype


def test_the_config_s_bf16_is_what_a_one_shot_job_saves_and_a_host_copy_is_never_widened():
    assert saved_dtype({"bf16": {"enabled": True}}) is torch.bfloat16
    assert saved_dtype({"bf16": {"enabled": False}}) is host_dtype()
    assert saved_dtype({}) is host_dtype()


def test_rounding_keeps_the_dtype_and_the_zeros_and_saving_then_changes_no_value():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    with torch.no_grad():
        model[0].weight[:, ::3] = 0
    zeros = model[0].weight == 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    round_to(model, torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype is torch.float32 and torch.equal(p, before[name].to(torch.bfloat16).float()), name
    assert torch.equal(model[0].weight == 0, zeros) and not all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    rounded = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(torch.bfloat16)
    assert all(torch.equal(p.float(), rounded[n]) for n, p in model.named_parameters())  # the saved values are the measured



WARM_START = """
import json, sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from elsa_ds.jobs.warm_start import oneshot_on_rank0
from elsa_ds.methods import OneShot
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.layerwise import layerwise_nll
from elsa_ds.oneshot.pipeline import accelerator, load_host_model, prune_oneshot, round_to
from elsa_ds.settings.config import ElsaConfig

model, out, port = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
cfg, tok = ElsaConfig(model=model, sparsity=0.5), AutoTokenizer.from_pretrained(model)
windows = torch.randint(0, tok.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
_, _, nll, _ = oneshot_on_rank0(cfg, OneShot.magnitude, ModelSource(model), tok, 0, out / "masks.safetensors", out / "x0", windows,
                             engine_dtype=torch.bfloat16)
plain, rounded = load_host_model(ModelSource(model)), load_host_model(ModelSource(model))
round_to(rounded, torch.bfloat16)
seen = {"nll": nll[0], "rounded_nll": layerwise_nll(rounded, windows, accelerator())[0],
        "plain_nll": layerwise_nll(plain, windows, accelerator())[0]}
want = dict(prune_oneshot(cfg, OneShot.magnitude, tok, rounded).model.named_parameters())
got = dict(load_host_model(ModelSource(str(out / "x0"))).named_parameters())
seen["same_x0"] = all(torch.equal(got[n].float(), w.float()) for n, w in want.items())
print(json.dumps(seen))
"""


def test_a_warm_start_prunes_and_measures_the_values_the_engine_will_hold(tmp_path, tiny_model_dir):
    """A CPU's fp32 host copy under a bf16 engine: the one-shot of --init_mask decides on the bf16 values the run trains, as
    the standalone one-shot job prunes the values it saves (the demo's two SparseGPT rows differed: 75.74 against 75.98),
    and the dense model is measured at them. Rank 0's real pass, in a process of its own (a one-rank gloo group)."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, free_port

    proc = subprocess.run([sys.executable, "-c", WARM_START, str(tiny_model_dir), str(tmp_path), str(free_port())], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["same_x0"] and seen["nll"] == seen["rounded_nll"] != seen["plain_nll"]
