"""bench/gathered.py: the scaled shapes keep the real models' proportions, and one case on a real engine agrees with the
estimate (the 27B-shaped jobs keep their head gathered from the forward to the backward, nothing more)."""
from __future__ import annotations

import pytest
from transformers import AutoConfig

from bench import gathered
from elsa_ds.capacity.memory import gathered_params, model_shape, resolve_model_config
from elsa_ds.models import SHIPPED_CONFIGS
from elsa_ds.zero.ds_config import DsConfig


@pytest.mark.parametrize("case", gathered.CASES, ids=lambda c: c[0])
def test_a_scaled_shape_keeps_the_real_models_proportions(case):
    _, model, layers, scale, _, _ = case
    small = model_shape(AutoConfig.for_model(**gathered.scaled_config(model, layers, scale)))
    real = model_shape(resolve_model_config(str(SHIPPED_CONFIGS / model)))
    assert small.layers == layers and small.tied == (small.largest_param if real.tied else 0)
    for field in ("largest_param", "largest_layer_params"):  # the head and a layer, / scale to within 20 %
        assert getattr(small, field) == pytest.approx(getattr(real, field) * scale, rel=0.2), field


@pytest.mark.integration
def test_a_27b_shaped_job_keeps_its_head_gathered_as_estimated():
    name, model, layers, scale, shipped, _ = gathered.CASES[0]
    config = gathered.scaled_config(model, layers, scale)
    zero = {k: v * scale for k, v in DsConfig.load(shipped).zero.items() if k in gathered.KNOBS}
    first, *later = gathered.run_case(config, zero)
    shape = model_shape(AutoConfig.for_model(**config))
    assert first == 0 and later == [shape.largest_param] * 2  # the tied head, used again at once by its backward
    assert gathered_params(shape, zero, False, "cuda") == shape.largest_param
