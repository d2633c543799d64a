"""elsa-estimate --measure times the job's own optimizer beside DeepSpeedCPUAdam on this host (the fused ELSA step and
one projection, with the job's base optimizer, z / u dtypes and remedies), and the estimate prices the optimizer's
host work with those ratios instead of the typical profile's."""
from __future__ import annotations

from dataclasses import replace

import pytest

from elsa_ds.capacity import optimizer_probe
from elsa_ds.capacity.memory import resolved_job
from elsa_ds.capacity.optimizer_probe import OptimizerTimings, measure_optimizer
from elsa_ds.capacity.step_time import TYPICAL, format_time, step_time
from elsa_ds.settings.config import resolve_config
from elsa_ds.zero.ds_config import DsConfig


def _job(config: str, **cli):
    view = DsConfig.load(f"ds_configs/{config}.json")
    cfg = resolve_config(view.raw, {"steps": 64, "interval": 8, **cli})
    shape, ds = resolved_job(cfg, view, 1)
    return view, cfg, shape, ds


def _adam_s(shape, rates) -> float:
    return shape.trainable_params / rates.adam  # one rank's DeepSpeedCPUAdam pass: what the ratios multiply


# the probe's own budget (30 s) is for users' hosts; a CI host running two test workers on 2 cores can take longer, which
# would leave the profile's ratios (the test below then checks that path): the tests that time give it room
LOADED_HOST_BUDGET_S = 300.0


def test_the_jobs_own_optimizer_is_timed_here_and_prices_its_step_and_projection(monkeypatch):
    monkeypatch.setattr(optimizer_probe, "PROBE_BUDGET_S", LOADED_HOST_BUDGET_S)
    view, cfg, shape, ds = _job("zero3_offload_elsal")
    timed = measure_optimizer(cfg, view)
    assert timed is not None and timed.key == "adam8bit_minifloat"  # ELSA-L's base, as its JSON sets it
    assert timed.adam_ms > 0 and timed.step_ms > 0 and timed.projection_ms > 0
    assert 0.3 < timed.kernel < 20 and 0.1 < timed.projection < 100   # ratios of two passes over the same entries
    assert timed.threads >= 1
    rates = replace(TYPICAL["cpu-2c"], adam=timed.entries / (timed.adam_ms / 1e3))  # the probe's DeepSpeedCPUAdam
    t = step_time(shape, ds, cfg, 1, 1, "cpu", TYPICAL["cpu-2c"], optimizer=timed)
    adam = _adam_s(shape, rates)
    assert t.components["optimizer"] == pytest.approx(adam * timed.kernel)
    assert t.components["projection"] == pytest.approx(adam * timed.projection / cfg.interval)
    assert t.run_parts["first projection"] == pytest.approx(adam * timed.projection)
    assert t.optimizer_timed["kernel"] == pytest.approx(timed.kernel)
    assert "its optimizer timed here (adam8bit_minifloat" in format_time(t)
    typical = step_time(shape, ds, cfg, 1, 1, "cpu", TYPICAL["cpu-2c"])
    assert typical.components["optimizer"] == pytest.approx(_adam_s(shape, TYPICAL["cpu-2c"]) * TYPICAL["cpu-2c"].kernel["adam8bit_minifloat"])
    assert typical.optimizer_timed is None and "optimizer timed" not in format_time(typical)


def test_a_remedy_timed_with_the_job_is_not_scaled_again_by_the_benchs_factors():
    """A figure timed with the authors' adaptive λ already holds its eager parts: REMEDY_FACTORS no longer apply; z₀ =
    Π(x) stays the fused projection of the base. Figures here are given, as a probe on a slower host would time them."""
    view, cfg, shape, ds = _job("zero3_offload", lmda_schedule="adaptive")
    timed = OptimizerTimings("cpu_adam+adaptive", adam_ms=10.0, step_ms=30.0, projection_ms=400.0, entries=40_000_000,
                             threads=16)
    rates = TYPICAL["gpu-vm-16c"]
    t = step_time(shape, ds, cfg, 1, 1, "cuda", rates, optimizer=timed)
    assert t.rates["adam"] == pytest.approx(4e9)  # DeepSpeedCPUAdam's rate: the probe's, 40 M entries in 10 ms
    rates = replace(rates, adam=4e9)
    adam = _adam_s(shape, rates)
    assert t.components["optimizer"] == pytest.approx(3.0 * adam)
    assert t.components["projection"] == pytest.approx(40.0 * adam / cfg.interval)
    assert t.run_parts["first projection"] == pytest.approx(rates.projection["cpu_adam"] * adam)
    # the same figures say nothing about a job without the remedy: it keeps the profile's
    _, plain_cfg, plain_shape, plain_ds = _job("zero3_offload")
    plain = step_time(plain_shape, plain_ds, plain_cfg, 1, 1, "cuda", rates, optimizer=timed)
    assert plain.components["optimizer"] == pytest.approx(rates.kernel["cpu_adam"] * adam)


def test_the_optimizer_on_the_gpu_is_not_timed_on_the_host():
    view, cfg, _, _ = _job("zero3")
    assert measure_optimizer(cfg, view) is None


def test_a_probe_that_cannot_finish_leaves_the_profiles_ratios_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(optimizer_probe, "PROBE_BUDGET_S", 0.0)
    view, cfg, _, _ = _job("zero3_offload")
    with caplog.at_level("WARNING"):
        assert measure_optimizer(cfg, view) is None
    assert any("could not be timed here (TimeoutError" in r.getMessage() and "profile's ratios" in r.getMessage()
               for r in caplog.records)

