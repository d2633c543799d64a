"""bench/plain_cell.py: a training cell without DeepSpeed. In fp32 its ELSA is the single-process reference's to the bit
(the same optimizer, batches and clipping over fp32 masters); against the real engine (one rank of ZeRO-3) a one-shot
warm start and a retraining run keep the engine's masks; what it cannot run is refused before any work."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import derived_config, run_entry
from tests.zero.test_reference_masks import ARGS, _reference_masks

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.integration


def plain_cell(args: list[str], check: bool = True, preexec_fn=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "plain_cell.py"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                                       **{k: v for k, v in __import__("os").environ.items()}},
                          preexec_fn=preexec_fn)
    assert not check or proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_fp32_elsa_is_the_reference_to_the_bit(tmp_path, tiny_model_dir, text_dir):
    ds_path = derived_config(tmp_path, bf16={"enabled": False})
    out = tmp_path / "plain"
    plain_cell(["--device", "cpu", "--deepspeed", str(ds_path), "--model", str(tiny_model_dir), "--dataset", str(text_dir),
                *ARGS, "--output_dir", str(out)])
    reference = _reference_masks(ds_path, tiny_model_dir, text_dir)
    weights = load_file(out / "model.safetensors")
    for name, mask in reference.items():
        assert torch.equal(weights[name] != 0, mask), name
    report = json.loads((out / "elsa_report.json").read_text())
    assert report["engine"] == "plain" and report["device"] == "cpu" and report["step_time_s"] > 0
    assert report["overall_sparsity"] == pytest.approx(0.6, abs=1e-3) and report["config"]["lr"] == 1e-3
    assert [p["step"] for p in report["projections"]] == [4, 8, 12] and report["projections"][-1]["final"]


def test_in_bf16_it_trains_the_engines_weights_bit_for_bit(tmp_path, tiny_model_dir, text_dir):
    """One rank of ZeRO-3 beside the plain loop, in the shipped configs' bf16 (fp32 on a CPU without a fast bf16 matmul,
    where the job switches it off: the same for both): ELSA from magnitude's pruned weights under optimizer offload
    (DeepSpeedCPUAdam), magnitude + retraining and the dense control with the optimizer kept (torch's Adam), gradients
    clipped in every step and the parameters in several sub-groups. Every exported weight the same to the bit: the clip
    as ZeRO-3 computes it (torch's clip_grad_norm_ left a bf16 ulp in ~0.04 % of the weights) and the start loaded as the
    engine loads it (the one-shot's host copy cast whole had its rotary inv_freq in bf16: another forward)."""
    common = ["--model", str(tiny_model_dir), "--dataset", str(text_dir), "--seqlen", "64", "--steps", "12", "--sparsity",
              "0.6", "--lr", "1e-3", "--val_windows", "0", "--baseline", "none", "--micro_batch", "2", "--seed", "3"]
    clipped = {"gradient_clipping": 0.05}
    configs = {base: derived_config(tmp_path, base, **clipped) for base in ("zero3_offload.json", "zero3.json")}
    for path in configs.values():  # sub-groups of ~30k entries: the tiny model's 110k parameters in four
        ds = json.loads(path.read_text())
        ds["zero_optimization"]["sub_group_size"] = 30000
        path.write_text(json.dumps(ds))
    runs = {"elsa": ("zero3_offload.json", ["--interval", "4", "--lmda", "0.05", "--init_mask", "magnitude", "--init_weights"]),
            "ft": ("zero3.json", ["--method", "magnitude", "--finetune", "full"]),
            "dense": ("zero3.json", ["--method", "dense", "--finetune", "full"])}
    for name, (base, extra) in runs.items():
        args = ["--deepspeed", str(configs[base]), *common, *extra]
        run_entry("prune.py", [*args, "--output_dir", str(tmp_path / f"{name}_engine")], ranks=1)
        plain_cell(["--device", "cpu", *args, "--output_dir", str(tmp_path / f"{name}_plain")])
        engine = load_file(tmp_path / f"{name}_engine" / "model.safetensors")
        plain = load_file(tmp_path / f"{name}_plain" / "model.safetensors")
        assert engine.keys() == plain.keys()
        for key, w in engine.items():
            assert w.dtype == plain[key].dtype and torch.equal(w, plain[key]), (name, key, int((w != plain[key]).sum()))
        report = json.loads((tmp_path / f"{name}_plain" / "elsa_report.json").read_text())
        assert report["overall_sparsity"] == (0.0 if name == "dense" else pytest.approx(0.6, abs=1e-3))  # the control: none


@pytest.mark.parametrize("extra, needle", [(["--method", "sparsegpt", "--finetune", "lora"], "--finetune full"),
                                           (["--method", "wanda"], "--finetune full"),
                                           (["--base_optimizer", "adam8bit_minifloat"], "fp32 Adam"),
                                           (["--val_windows", "4"], "val_windows"),
                                           (["--resume"], "resume")])
def test_what_the_loop_does_not_run_is_refused_before_work(tmp_path, tiny_model_dir, text_dir, extra, needle):
    proc = plain_cell(["--device", "cpu", "--deepspeed", "ds_configs/zero3.json", "--model", str(tiny_model_dir),
                       "--dataset", str(text_dir), "--steps", "2", "--seqlen", "64", "--val_windows", "0",
                       "--output_dir", str(tmp_path / "out"), *extra], check=False)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_a_folder_of_its_own_is_not_replaced_without_overwrite(tmp_path, tiny_model_dir, text_dir):
    """The cell writes its model beside the output and renames it in place; what the output already held stays unless
    --overwrite says otherwise (the job's own refusal, before any work)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("kept")
    proc = plain_cell(["--device", "cpu", "--deepspeed", "ds_configs/zero3.json", "--model", str(tiny_model_dir), "--dataset",
                       str(text_dir), "--steps", "2", "--seqlen", "64", "--val_windows", "0", "--output_dir", str(out)],
                      check=False)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and (out / "precious.txt").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left beside it


def test_the_output_is_swapped_in_under_its_lock_and_a_planted_link_beside_it_is_never_written_through(tmp_path, tiny_model_dir,
                                                                                                      text_dir):
    """An audit (2026-12-03): the cell built its model in a fixed ``.out.partial`` (a link planted there was written
    through), removed the previous output before its rename, left the staging on a failure, and took no lock. Now it
    builds in the job's own staging (``fresh_staging``: named for the process, leftovers named and never touched), swaps
    it in with ``publish`` and holds the output's lock: a cell on an output another job holds is refused before work."""
    from elsa_ds.files.ownership import acquire, release

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    (out / "previous.txt").write_text("the previous cell's")
    (out / "elsa_report.json").write_text("{}")
    elsewhere.mkdir()
    (tmp_path / ".out.partial").symlink_to(elsewhere, target_is_directory=True)
    args = ["--device", "cpu", "--deepspeed", "ds_configs/zero3.json", "--model", str(tiny_model_dir), "--dataset",
            str(text_dir), "--steps", "2", "--seqlen", "64", "--val_windows", "0", "--output_dir", str(out), "--overwrite"]
    fd = acquire(out, "--output_dir")
    try:
        held = plain_cell(args, check=False)
    finally:
        release(out, fd)
    assert held.returncode == 2 and "--output_dir" in held.stderr and "Traceback" not in held.stderr, held.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["elsa_report.json", "previous.txt"]
    plain_cell(args)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "elsa_report.json", "generation_config.json",
                                                            "model.safetensors", *_tokenizer_files(tiny_model_dir)])
    assert list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial", "elsewhere", "out"]  # the lock went with the job


def _tokenizer_files(model_dir: Path) -> list[str]:
    return [p.name for p in model_dir.iterdir() if p.name.startswith(("tokenizer", "special_tokens"))]


def test_an_output_published_after_the_check_is_refused_under_the_lock(tmp_path, tiny_model_dir, text_dir, monkeypatch, capsys):
    """A second audit: the output was checked once, before the lock; a job that published there in between had its
    output replaced without --overwrite. The cell checks it again under the lock, as the jobs do (``jobs/owner``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plain_cell_under_test", ROOT / "bench" / "plain_cell.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    checked = module.parse

    def parse_then_another_job_publishes(argv):
        parsed = checked(argv)
        out.mkdir()
        (out / "elsa_report.json").write_text("another job's")
        return parsed

    monkeypatch.setattr(module, "parse", parse_then_another_job_publishes)
    code = module.main(["--device", "cpu", "--deepspeed", "ds_configs/zero3.json", "--model", str(tiny_model_dir), "--dataset",
                        str(text_dir), "--steps", "2", "--seqlen", "64", "--val_windows", "0", "--output_dir", str(out)])
    assert code == 2 and "--overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["elsa_report.json"] and (out / "elsa_report.json").read_text() == "another job's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_full_disk_as_the_model_is_written_is_one_line_and_leaves_nothing(tmp_path, tiny_model_dir, text_dir):
    """A second audit: ENOSPC from ``save_pretrained`` left the cell with a traceback (its staging was removed). Now one
    line naming the disk, exit 2, nothing beside the output (here a file size limit fails the write, as a full disk does)."""
    import resource
    import signal

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # the tiny model's weights are larger

    out = tmp_path / "out"
    proc = plain_cell(["--device", "cpu", "--deepspeed", "ds_configs/zero3.json", "--model", str(tiny_model_dir), "--dataset",
                       str(text_dir), "--steps", "2", "--seqlen", "64", "--val_windows", "0", "--output_dir", str(out)],
                      check=False, preexec_fn=limit)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")][0].startswith("error: file size limit"), \
        proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_compiled_cell_trains_as_the_eager_one_and_says_what_compiled(tmp_path, tiny_model_dir, text_dir):
    """``--compile inductor``: the steps call the model through ``torch.compile`` (the GPU's lever: fused graphs, fewer
    launches a step; here inductor's C++ code for the CPU, ~30 s of compiling on 2 cores, where the GPU gets Triton's). In
    fp32 the cell keeps the eager cell's masks and its weights to rounding (4e-7 apart on the AMD box, 2026-12-04); its report names the
    backend, the graphs it compiled and the first step (the compile's) apart from the mean; the export is the model's
    own (no wrapper in the weights' names)."""
    ds_path = derived_config(tmp_path, bf16={"enabled": False})
    reports, weights = {}, {}
    for backend in ("none", "inductor"):
        out = tmp_path / backend
        plain_cell(["--device", "cpu", "--compile", backend, "--deepspeed", str(ds_path), "--model", str(tiny_model_dir),
                    "--dataset", str(text_dir), *ARGS, "--output_dir", str(out)])
        reports[backend] = json.loads((out / "elsa_report.json").read_text())
        weights[backend] = load_file(out / "model.safetensors")
    assert reports["none"]["compile"] is None and "compiled_graphs" not in reports["none"]
    compiled = reports["inductor"]
    assert compiled["compile"] == "inductor" and compiled["compiled_graphs"] >= 1
    assert compiled["first_step_s"] > 10 * compiled["step_time_s"]  # the compile is in the first step, not in the mean
    assert weights["inductor"].keys() == weights["none"].keys()
    for name, w in weights["none"].items():
        assert torch.equal(w != 0, weights["inductor"][name] != 0), name
        torch.testing.assert_close(weights["inductor"][name], w, rtol=1e-4, atol=1e-5)
    assert compiled["final_loss"] == pytest.approx(reports["none"]["final_loss"], rel=1e-4)


def test_a_graph_the_backend_cannot_compile_runs_eagerly_and_the_report_says_none_compiled():
    """A backend that fails (as inductor might on a GPU no session here can test) must not cost the cell: the forward
    and backward run eagerly, the gradients are the eager ones, and the report's ``compiled_graphs`` is 0. (The switches
    compile_model turns on for the whole process are put back by torch's own ``config.patch``: pytest's monkeypatch
    deletes a torch config entry on undo, which broke every later DeepSpeed engine on the worker, 2026-12-04.)"""
    import importlib.util

    import torch._dynamo
    import torch._functorch.config

    spec = importlib.util.spec_from_file_location("plain_cell_compile", ROOT / "bench" / "plain_cell.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch._dynamo.config.patch(suppress_errors=False), torch._functorch.config.patch(force_non_lazy_backward_lowering=False):
        _failing_backends_fall_back(module)
    assert not torch._dynamo.config.suppress_errors and not torch._functorch.config.force_non_lazy_backward_lowering


def _failing_backends_fall_back(module) -> None:
    from functorch.compile import make_boxed_func
    from torch._dynamo import register_backend
    from torch._dynamo.backends.common import aot_autograd

    def broken(gm, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    register_backend(broken, name="elsa_ds_test_broken")
    # a review (2026-12-04): a backend whose forward compiles but whose backward fails raised in .backward(), since
    # AOTAutograd compiles the backward lazily, outside dynamo's error handling; now it compiles with the forward
    register_backend(aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=broken),
                     name="elsa_ds_test_broken_backward")
    torch._dynamo.reset()
    _ = torch.compile(torch.nn.Linear(2, 2), backend="aot_eager")(torch.randn(1, 2))  # a graph counted before the cell's
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    for backend in ("elsa_ds_test_broken", "elsa_ds_test_broken_backward"):
        model.zero_grad()
        forward = module.compile_model(model, backend)
        forward(x).sum().backward()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), eager)), backend
        report = module.compile_report(backend, [1.5])
        assert report == {"compile": backend, "compiled_graphs": 0, "graph_breaks": 0, "first_step_s": 1.5}, report
    assert module.compile_model(model, "none") is model and module.compile_report("none", []) == {"compile": None}
    torch._dynamo.reset()
