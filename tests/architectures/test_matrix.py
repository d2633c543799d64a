"""Every architecture the README names (Llama, Mistral, Qwen2, OPT, Gemma, Gemma-2, Gemma-3), end to end on tiny random models:
ELSA under ZeRO-3 on 2 ranks against the single-process reference mask, each one-shot method, the export reloaded
with ``from_pretrained``, and the evaluation code on the result."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from elsa_ds.data import GlobalBatches, load_blocks
from elsa_ds.jobs.evaluate import EvalSettings, run
from elsa_ds.models import load_causal_lm
from elsa_ds.reference import train_reference
from elsa_ds.settings.config import resolve_config
from elsa_ds.targets import select_targets
from elsa_ds.zero.ds_config import DsConfig
from tests.architectures.models import ARCHS, make_arch_model
from tests.conftest import ROOT, derived_config, run_entry

pytestmark = pytest.mark.integration

SETTINGS = {"seqlen": 64, "steps": 8, "interval": 4, "sparsity": 0.6, "lr": 1e-3, "lmda": 0.05, "micro_batch": 2, "seed": 3,
            "init_mask": "none"}  # x₀ dense, as the reference starts


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory, tiny_model_dir) -> dict:
    base = tmp_path_factory.mktemp("archs")
    return {arch: make_arch_model(base / arch, arch, tiny_model_dir) for arch in ARCHS}


@pytest.fixture(scope="module")
def ds_fp32(tmp_path_factory):
    return derived_config(tmp_path_factory.mktemp("ds"), bf16={"enabled": False})


@pytest.fixture(scope="module")
def elsa_outputs(tmp_path_factory, arch_dirs, text_dir, ds_fp32) -> dict:
    """ELSA on every architecture in one 2-rank launch (one process group serves every job)."""
    base = tmp_path_factory.mktemp("elsa")
    outs = {arch: base / arch for arch in ARCHS}
    spec = base / "spec.json"
    spec.write_text(json.dumps({"deepspeed": str(ds_fp32), "dataset": str(text_dir),
                                "settings": {**SETTINGS, "val_windows": 4, "baseline": "none"},
                                "runs": {str(outs[a]): str(arch_dirs[a]) for a in ARCHS}}))
    run_entry(str(ROOT / "tests" / "architectures" / "run_elsa.py"), [str(spec)], ranks=2, timeout=1200)
    return outs


def _reference(model_dir, text_dir, ds_path) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    raw = DsConfig.load(ds_path).raw
    cfg = resolve_config(raw, {"model": str(model_dir), "dataset": str(text_dir), **SETTINGS})
    tok = AutoTokenizer.from_pretrained(model_dir)
    blocks = load_blocks(cfg.dataset, "train", tok, cfg.seqlen, max_blocks=cfg.steps * raw["train_batch_size"])
    batches = GlobalBatches(blocks, raw["train_batch_size"], cfg.micro_batch, 1, 0, cfg.seed)
    model = load_causal_lm(str(model_dir), torch.float32)  # the job's attention implementation
    return train_reference(model, cfg, batches, select_targets(model, None), raw["gradient_clipping"])


def _reloads_and_evaluates(out, text_dir, sparsity: float) -> None:
    """from_pretrained gives finite logits, ties survive, and the evaluation entry point's code reads the export."""
    model = load_causal_lm(str(out), torch.float32)
    if getattr(model.config, "tie_word_embeddings", False):
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(3, 512, (1, 16))
    assert torch.isfinite(model(input_ids=ids).logits).all()
    result = run(EvalSettings(model=str(out), ppl=[str(text_dir / "othello.txt")], seqlen=64, limit=4))
    assert math.isfinite(result["ppl"][str(text_dir / "othello.txt")]["ppl"])
    assert result["sparsity"]["overall"] == pytest.approx(sparsity, abs=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_elsa_on_two_ranks_reproduces_the_reference(arch, arch_dirs, elsa_outputs, text_dir, ds_fp32):
    out = elsa_outputs[arch]
    report = json.loads((out / "elsa_report.json").read_text())
    assert report["world_size"] == 2
    weights = load_file(out / "model.safetensors")
    reference = _reference(arch_dirs[arch], text_dir, ds_fp32)
    assert set(reference) == set(report["layers"])
    agree = 0
    for name, ref_mask in reference.items():
        mask = weights[name] != 0
        assert int((~mask).sum()) == round(0.6 * mask.numel()) == report["layers"][name]["zeros"], name
        agree += int((mask == ref_mask).sum())
    assert agree / sum(m.numel() for m in reference.values()) >= 0.999
    _reloads_and_evaluates(out, text_dir, report["overall_sparsity"])


@pytest.mark.parametrize("arch", ARCHS)
def test_oneshot_methods_export_and_evaluate(arch, arch_dirs, text_dir, tmp_path):
    """magnitude and wanda layer by layer in process (exact sparsity per layer); sparsegpt as the whole job, then the
    export reloaded and evaluated."""
    import elsa_ds
    from transformers import AutoTokenizer

    from elsa_ds.oneshot.methods import prune_model

    windows = load_blocks(str(text_dir), "train", AutoTokenizer.from_pretrained(arch_dirs[arch]), 64, max_blocks=4)
    for method in ("magnitude", "wanda"):
        model = load_causal_lm(str(arch_dirs[arch]), torch.float32)
        names = list(select_targets(model, None).values())
        masks = prune_model(model, method, dict.fromkeys(names, 0.6), windows, torch.device("cpu"))
        weights = dict(model.named_parameters())
        for name in names:
            assert int((~masks[name]).sum()) == round(0.6 * masks[name].numel()) == int((weights[name] == 0).sum()), (method, name)
    out = tmp_path / "sparsegpt"
    report = elsa_ds.oneshot(str(arch_dirs[arch]), "sparsegpt", str(text_dir), output_dir=out, sparsity=0.6, seqlen=64,
                             nsamples=4, val_windows=4)
    assert report["method"] == "sparsegpt" and report["layers"]
    assert all(layer["zeros"] == round(0.6 * layer["numel"]) for layer in report["layers"].values())
    assert math.isfinite(report["ppl"]["pruned"])
    _reloads_and_evaluates(out, text_dir, report["overall_sparsity"])
