"""A multimodal Gemma-3 (``Gemma3ForConditionalGeneration``: a SigLIP vision tower beside a Gemma-3 text decoder), tiny and
random: by default only the text decoder's Linear layers are pruned, the one-shot methods calibrate through the text
decoder (not the vision tower's layer list), and the export reloads with ``from_pretrained`` with every weight outside
the pruned layers, the vision tower's included, bit for bit as it was."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from elsa_ds.data import load_blocks
from elsa_ds.models import load_causal_lm
from elsa_ds.targets import decoder_layer_list, select_targets
from tests.architectures.models import make_arch_model
from tests.conftest import ROOT, derived_config, run_entry

SPARSITY = 0.6


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory, tiny_model_dir):
    return make_arch_model(tmp_path_factory.mktemp("gemma3_mm"), "gemma3", tiny_model_dir)


def test_default_targets_are_the_text_decoders_linears(mm_dir):
    model = load_causal_lm(str(mm_dir), torch.float32)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    names = set(select_targets(model, None).values())
    vision = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "vision" in n]
    assert vision, "the tiny model has a vision tower with Linear layers"
    assert names == {f"{n}.weight" for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and n.startswith("model.language_model.layers.")}
    assert len(names) == 7 * model.config.text_config.num_hidden_layers
    assert decoder_layer_list(model) is model.model.language_model.layers


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_oneshot_prunes_only_the_text_decoder_and_keeps_the_vision_tower(method, mm_dir, text_dir, tmp_path):
    import elsa_ds
    from transformers import AutoModelForCausalLM

    out = tmp_path / method
    report = elsa_ds.oneshot(str(mm_dir), method, str(text_dir), output_dir=out, sparsity=SPARSITY, seqlen=64, nsamples=4,
                             val_windows=4)
    assert report["layers"] and all(name.startswith("model.language_model.layers.") for name in report["layers"])
    assert all(layer["zeros"] == round(SPARSITY * layer["numel"]) for layer in report["layers"].values())
    assert math.isfinite(report["ppl"]["pruned"])
    exported = load_file(out / "model.safetensors")
    for name, layer in report["layers"].items():  # the report's names are the export's keys
        assert int((exported[name] == 0).sum()) == layer["zeros"], name
    before = AutoModelForCausalLM.from_pretrained(mm_dir, dtype=torch.float32).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(reloaded).__name__ == "Gemma3ForConditionalGeneration"
    after = reloaded.state_dict()
    assert set(after) == set(before)
    untouched = [k for k in before if k not in report["layers"]]
    assert any(k.startswith("model.vision_tower.") for k in untouched)
    assert any(k.startswith("model.multi_modal_projector.") for k in untouched)
    saved = {t.dtype for t in exported.values()}  # the config's bf16 (fp32 where this CPU turns it off)
    assert len(saved) == 1
    for key in untouched:  # vision tower, projector, embeddings, norms: bit for bit, in the dtype the job saves
        assert torch.equal(after[key], before[key].to(*saved).float()), key
    for key in report["layers"]:
        assert torch.equal(after[key], exported[key].float()) and not torch.equal(after[key], before[key]), key
    ids = load_blocks(str(text_dir), "train", elsa_ds_tokenizer(mm_dir), 64, max_blocks=1)
    assert torch.isfinite(reloaded(input_ids=ids).logits).all()


@pytest.mark.integration
@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_elsa_on_two_ranks_trains_the_text_decoder_and_keeps_the_vision_tower(mm_dir, text_dir, tmp_path):
    """ELSA under ZeRO-3 on 2 ranks: the text decoder's linears at the target, the vision tower and the projector (no
    gradient without images) bit for bit, the export reloaded as the multimodal class."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "elsa"
    settings = {"seqlen": 64, "steps": 4, "interval": 2, "sparsity": SPARSITY, "lr": 1e-3, "lmda": 0.05, "micro_batch": 2,
                "seed": 3, "init_mask": "none", "val_windows": 2, "baseline": "none"}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"deepspeed": str(derived_config(tmp_path, bf16={"enabled": False})), "dataset": str(text_dir),
                                "settings": settings, "runs": {str(out): str(mm_dir)}}))
    run_entry(str(ROOT / "tests" / "architectures" / "run_elsa.py"), [str(spec)], ranks=2, timeout=1200)
    report = json.loads((out / "elsa_report.json").read_text())
    assert report["world_size"] == 2 and all(name.startswith("model.language_model.layers.") for name in report["layers"])
    assert len(report["layers"]) == 14 and all(layer["zeros"] == round(SPARSITY * layer["numel"]) for layer in report["layers"].values())
    before = AutoModelForCausalLM.from_pretrained(mm_dir, dtype=torch.float32).state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(reloaded).__name__ == "Gemma3ForConditionalGeneration"
    after = reloaded.state_dict()
    kept = [k for k in before if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))]
    assert kept and all(torch.equal(after[k], before[k]) for k in kept)
    for name, layer in report["layers"].items():
        assert int((after[name] == 0).sum()) == layer["zeros"], name


def elsa_ds_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
