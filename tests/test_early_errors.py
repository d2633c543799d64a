"""Each bad input found by trying the tool as a new user would: one line on stderr, exit code 2, no traceback, no work
started (the job never reaches its resolved-config banner, printed after the checks), nothing overwritten."""
from __future__ import annotations

import json
import shutil

import pytest

from elsa_ds.errors import ElsaError
from elsa_ds.settings.config import resolve_config
from elsa_ds.zero.ds_config import DsConfig
from tests.conftest import ROOT, mounted, run_entry, run_fails

BANNER = "resolved ELSA config"  # printed once every check has passed


def _prune_fails(args: list[str], *needles: str) -> None:
    proc = run_entry("prune.py", args, check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert BANNER not in proc.stdout


def test_truncated_safetensors_is_named_before_loading(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _prune_fails(["--deepspeed", "zero3", "--model", str(model), "--output_dir", str(tmp_path / "o")], "model.safetensors is damaged")
    assert not (tmp_path / "o").exists()


def test_binary_text_file_in_the_dataset(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_bytes(bytes(range(256)) * 64)
    proc = run_entry("prune.py", ["--deepspeed", "zero3", "--model", str(tiny_model_dir), "--dataset", str(data), "--seqlen", "64",
                                  "--output_dir", str(tmp_path / "o")], check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "notes.txt: not UTF-8 text" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_compare_of_a_pruning_report_explains_itself(tmp_path):
    report = tmp_path / "run" / "elsa_report.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"model": "m", "method": "elsa", "layers": {}, "ppl": {"dense": 1.0, "pruned": 2.0}}))
    run_fails("evaluate.py", ["--compare", str(report)], "a pruning job's report, not an evaluation result", "launch/evaluate.py --model")


def test_eval_ppl_path_typo_is_caught_before_any_work(tmp_path):
    _prune_fails(["--deepspeed", "zero3_offload", "--eval_ppl", str(tmp_path / "valdation.txt"), "--output_dir", str(tmp_path / "o")],
                 "eval_ppl", "valdation.txt': no such file or directory")
    assert not (tmp_path / "o").exists()


def test_evaluate_output_that_is_a_directory_is_refused_before_loading(tmp_path, tiny_model_dir):
    existing = tmp_path / "results"
    existing.mkdir()
    (existing / "keep.json").write_text("{}")
    proc = run_entry("evaluate.py", ["--model", str(tiny_model_dir), "--ppl", "shakespeare", "--output", str(existing)], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--output" in proc.stderr and "is a directory" in proc.stderr
    assert "loaded" not in proc.stdout and (existing / "keep.json").read_text() == "{}"


def test_targets_matching_nothing_is_caught_before_loading(tmp_path, tiny_model_dir):
    _prune_fails(["--deepspeed", "zero3", "--model", str(tiny_model_dir), "--targets", r"no_such_module\d",
                  "--output_dir", str(tmp_path / "o")], "matches no nn.Linear")


def test_stage2_config_is_refused_by_oneshot_and_the_estimator(tmp_path, tiny_model_dir):
    cfg = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    cfg["zero_optimization"]["stage"] = 2
    path = tmp_path / "zero2.json"
    path.write_text(json.dumps(cfg))
    _prune_fails(["--deepspeed", str(path), "--method", "magnitude", "--model", str(tiny_model_dir),
                  "--output_dir", str(tmp_path / "o")], "stage must be 3")
    run_fails("estimate.py", ["--model", "google/gemma-2-2b", "--deepspeed", str(path)], "stage must be 3")


def test_estimator_refuses_a_micro_batch_that_does_not_divide_the_global_batch():
    run_fails("estimate.py", ["--model", "google/gemma-2-2b", "--deepspeed", "zero3_offload", "--num_gpus", "3"],
              "train_batch_size 8 is not a multiple of micro batch 1 x 3 ranks", "pass --batch_size 9 (or another multiple of 3)")


def test_a_global_batch_from_a_recipe_is_named_as_such_with_the_batch_that_fits():
    """A recipe's batch_size takes the place of the JSON's train_batch_size; on 2 nodes x 8 GPUs the refusal named the
    JSON's key with the recipe's value (a user's walk, 2026-11-30): it now says where the batch came from and what fits."""
    run_fails("estimate.py", ["--recipe", "gemma-2-27b-s90", "--deepspeed", "zero3_offload", "--num_gpus", "8", "--num_nodes", "2"],
              "the global batch 8 (batch_size of the settings: --batch_size, a recipe or the elsa block; the JSON's "
              "train_batch_size 8 gives way to it) is not a multiple of micro batch 1 x 16 ranks; pass --batch_size 16")
    error = run_fails("estimate.py", ["--recipe", "gemma-2-27b-s90", "--deepspeed", "zero3_offload", "--num_gpus", "8",
                                      "--num_nodes", "2"], "or fewer ranks")
    assert "smaller --micro_batch" not in error  # it is 1 already (a user's walk, 2026-12-01)


def test_the_estimator_refuses_what_the_job_could_not_run_or_a_profile_of_another_kind():
    """A user's walk (2026-12-01): DeepSpeedCPUAdam with the optimizer on the GPU was priced, where the job would fail at
    its first step after loading the weights (the job's plan refuses it too); a CPU host's profile timed GPU ranks."""
    run_fails("estimate.py", ["--model", "google/gemma-2-2b", "--deepspeed", "zero3", "--base_optimizer", "cpu_adam"],
              "--base_optimizer cpu_adam (DeepSpeedCPUAdam) steps tensors in host memory", "no offload_optimizer")
    run_fails("estimate.py", ["--model", "google/gemma-2-2b", "--deepspeed", "zero3_offload", "--machine", "cpu-2c"],
              "--machine cpu-2c is a CPU host's profile but --accelerator is cuda")
    run_fails("estimate.py", ["--model", "google/gemma-2-2b", "--deepspeed", "zero3", "--accelerator", "cpu", "--machine",
                              "gpu-server"], "--machine gpu-server is a GPU host's profile but --accelerator is cpu")
    import torch

    if not torch.cuda.is_available():  # a walk (2026-12-02): a Traceback from torch ("not compiled with CUDA") at the matmul
        run_fails("estimate.py", ["--model", "google/gemma-2-27b", "--deepspeed", "zero3_offload_elsal", "--measure"],
                  "--measure times this machine's rates and --accelerator is cuda (the default), but this machine has no CUDA")
    from elsa_ds.settings.config import ElsaConfig
    from elsa_ds.zero.ds_config import DsConfig

    cfg = ElsaConfig(base_optimizer="cpu_adam")
    assert DsConfig.load("zero3").base_optimizer_problem(cfg, "cuda") is not None
    assert DsConfig.load("zero3").base_optimizer_problem(cfg, "cpu") is None  # the CPU accelerator's tensors are the host's
    assert DsConfig.load("zero3_offload").base_optimizer_problem(cfg, "cuda") is None


def test_a_mistyped_model_id_is_refused_at_once_with_the_shipped_ids_near_it(monkeypatch):
    """A user's walk (2026-12-01): google/gemma-3-27b took 26 s of the hub client's retries and 12 lines offline; now one
    line in seconds naming the shipped ids it is near, and whether the hub could be asked."""
    import time

    from huggingface_hub import constants

    from elsa_ds.data import hub_texts

    started = time.time()  # offline as CI is (and whatever proxy its environment names): the hub is not asked
    proc = run_entry("estimate.py", ["--model", "google/gemma-3-27b", "--deepspeed", "zero3_offload"], check=False,
                     env={"HF_HUB_OFFLINE": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in ("cannot resolve model 'google/gemma-3-27b'", "did you mean", "google/gemma-3-27b-pt", "HF_HUB_OFFLINE"):
        assert needle in errors[0], errors[0]
    assert time.time() - started < 20, errors[0]
    for variable in hub_texts.PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://no-such-host.invalid")
    started = time.time()
    assert "no-such-host.invalid" in hub_texts.hub_unreachable() and time.time() - started < 5
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # the hub client goes through it; a direct probe would not
    assert hub_texts.hub_unreachable() is None
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_texts.hub_unreachable() == "HF_HUB_OFFLINE is set"


def test_a_hub_model_this_machine_lacks_is_refused_at_once_when_the_hub_cannot_be_asked(tmp_path):
    """A walk (2026-12-02): a recipe naming google/gemma-2-27b, offline, took 29 s of the hub client's retries before its
    error; now one line in seconds saying what to do. Real processes, the hub's host one that cannot resolve."""
    import time

    from elsa_ds.data import hub_texts

    env = {"HF_ENDPOINT": "https://no-such-host.invalid", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
           **{v: "" for v in hub_texts.PROXY_VARIABLES}}
    for script, args in (("prune.py", ["--recipe", "gemma-2-27b-s90", "--deepspeed", "zero3_offload", "--output_dir",
                                       str(tmp_path / "out")]),
                         ("evaluate.py", ["--model", "google/gemma-2-2b", "--ppl", str(ROOT / "README.md")])):
        started = time.time()
        proc = run_entry(script, args, check=False, env=env)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        for needle in ("not a folder here nor in the Hugging Face cache", "no-such-host.invalid", "hf download"):
            assert needle in errors[0], errors[0]
        assert time.time() - started < 20 and not (tmp_path / "out").exists(), errors[0]


def test_a_rendezvous_port_another_job_holds_is_named_with_what_to_do(tmp_path):
    """A walk (2026-12-02): a second `deepspeed` command on the default port 29500 failed on rank 0 (EADDRINUSE) and said
    only that "another rank of this job ended first". Rank 0 of two, its port held by a real listening socket."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        proc = run_entry("prune.py", ["--deepspeed", "zero3_offload", "--steps", "4", "--interval", "2", "--output_dir",
                                      str(tmp_path / "out")], check=False, env=env, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"the rendezvous port {port} is in use" in errors[0] and "--master_port" in errors[0], errors[0]
    assert not (tmp_path / "out").exists()
    assert "DeepSpeed config" not in proc.stdout, "said before the plan's checks (a walk: ~50 s of them first)"


def test_the_port_check_leaves_torchruns_agent_store_and_other_ranks_alone():
    """Under torchrun the agent's store already listens on MASTER_PORT (rank 0 only connects to it), and ranks other than
    0 serve nothing: neither is a clash. Rank 0 of a plain launch with the port held is one. In a fresh interpreter: a
    process group an earlier in-process job left up would make the check stand aside (as it must for a second job)."""
    import subprocess
    import sys

    script = """
import os, socket
from elsa_ds.errors import ElsaError
from elsa_ds.zero.rendezvous import check_rendezvous_port
with socket.socket() as held:
    held.bind(("127.0.0.1", 0))
    held.listen()
    os.environ["MASTER_PORT"] = str(held.getsockname()[1])
    os.environ["RANK"] = "1"
    check_rendezvous_port()
    os.environ.update(RANK="0", TORCHELASTIC_USE_AGENT_STORE="True")
    check_rendezvous_port()
    del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
    try:
        check_rendezvous_port()
    except ElsaError as e:
        print("refused:", e)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("refused:") and "is in use" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_a_second_job_of_a_launched_process_is_not_refused_for_its_own_groups_port(monkeypatch):
    """A script launched by deepspeed that runs two jobs: the first job's process group stays up and its store listens on
    MASTER_PORT; the second job's plan must not take that for another job's."""
    import torch.distributed as dist

    from elsa_ds.zero.dist import free_port
    from elsa_ds.zero.rendezvous import check_rendezvous_port

    ours = not dist.is_initialized()
    port = free_port()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", str(port))
    if ours:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        check_rendezvous_port()
    finally:
        if ours:
            dist.destroy_process_group()


def _stock_transformers_config() -> dict:
    """transformers' documented ZeRO-3 example (docs: main_classes/deepspeed), "auto" everywhere."""
    return {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }


def test_stock_transformers_zero3_config_resolves_its_autos():
    ds = DsConfig(_stock_transformers_config())
    cfg = resolve_config(ds.raw, {"batch_size": 16, "micro_batch": 2})
    engine = ds.engine_config(cfg, world_size=2, hidden_size=256)
    assert engine["train_batch_size"] == 16 and engine["train_micro_batch_size_per_gpu"] == 2 and engine["gradient_accumulation_steps"] == 4
    assert engine["zero_optimization"]["reduce_bucket_size"] == 256 * 256
    assert engine["zero_optimization"]["stage3_param_persistence_threshold"] == 2560
    assert engine["gradient_clipping"] == 1.0 and engine["bf16"]["enabled"] is True and engine["fp16"]["enabled"] is False
    assert "optimizer" not in engine and "scheduler" not in engine
    assert "auto" not in json.dumps(engine)


def test_every_problem_of_a_config_is_reported_at_once(tmp_path):
    raw = _stock_transformers_config()
    raw["optimizer"]["params"]["lr"] = 3e-5
    raw["optimizer"]["params"]["betas"] = [0.8, 0.95]  # advice as typed: --betas 0.8 0.95, not a list (an audit)
    raw["scheduler"]["params"]["warmup_num_steps"] = 100
    raw["zero_optimization"]["stage3_max_live_parameters"] = "auto"
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(raw))
    _prune_fails(["--deepspeed", str(path), "--output_dir", str(tmp_path / "o")],
                 "train_batch_size is missing or \"auto\"", "optimizer.params.lr=3e-05", "--lr 3e-05", "scheduler.params",
                 "pass --betas 0.8 0.95 or set it",
                 "zero_optimization.stage3_max_live_parameters is \"auto\"")
    with pytest.raises(ElsaError, match=r"\(1\).*\(2\).*\(3\).*\(4\).*\(5\)"):
        ds = DsConfig(raw)
        ds.engine_config(resolve_config(raw, {}), 1, 64)


def test_each_settings_source_is_checked_and_named(tmp_path):
    """A recipe's bad value is the recipe's error, also when the command line overrides it; the JSON's "elsa" block is
    named as such; a gradient_accumulation_steps that contradicts the batch split is refused, not replaced."""
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"source": "a test", "settings": {"steps": "four", "interval": 2}}))
    _prune_fails(["--deepspeed", "zero3_offload", "--recipe", str(recipe), "--steps", "4", "--output_dir", str(tmp_path / "o")],
                 f'invalid setting in recipe {recipe}: steps="four"')  # as the file spells it
    raw = json.loads((ROOT / "ds_configs" / "zero3_offload.json").read_text())
    block = tmp_path / "block.json"
    block.write_text(json.dumps({**raw, "elsa": {"interval": "two"}}))
    _prune_fails(["--deepspeed", str(block), "--interval", "4", "--output_dir", str(tmp_path / "o")],
                 f'the "elsa" block of {block}: interval="two"')
    accumulation = tmp_path / "accumulation.json"
    accumulation.write_text(json.dumps({**raw, "gradient_accumulation_steps": 3}))
    _prune_fails(["--deepspeed", str(accumulation), "--micro_batch", "2", "--output_dir", str(tmp_path / "o")],
                 "gradient_accumulation_steps 3 disagrees with train_batch_size 8 / (micro batch 2 x 1 ranks) = 4")
    fine = tmp_path / "fine.json"
    fine.write_text(json.dumps({**raw, "gradient_accumulation_steps": 4}))
    assert DsConfig.load(str(fine)).engine_config(resolve_config({}, {"micro_batch": 2}), 1, 64)["gradient_accumulation_steps"] == 4


def test_model_folder_without_a_tokenizer_is_named(tmp_path, tiny_model_dir, text_dir):
    """A folder with weights and no vocabulary: named by prune (every method) and by evaluate, before the model loads."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix == ".safetensors" or f.name == "config.json":
            shutil.copy(f, bare / f.name)
    for method in ("elsa", "magnitude"):
        _prune_fails(["--deepspeed", "zero3_offload", "--method", method, "--model", str(bare), "--dataset", str(text_dir),
                      "--output_dir", str(tmp_path / "o")], f"model {bare} has no tokenizer")
    run_fails("evaluate.py", ["--model", str(bare), "--ppl", str(text_dir), "--seqlen", "64"], f"model {bare} has no tokenizer")


def test_a_file_given_as_the_model_is_named_as_one(tmp_path, tiny_model_dir):
    """A walk: ``--model .../model.safetensors`` was read as a config ("can't decode byte 0x88"), and ``--model
    .../config.json`` failed in the tokenizer's loader; the estimate still takes a config.json."""
    for file in ("model.safetensors", "config.json"):
        model = str(tiny_model_dir / file)
        _prune_fails(["--deepspeed", "zero3", "--model", model, "--output_dir", str(tmp_path / "out")], "is a file, not a model")
        run_fails("evaluate.py", ["--model", model, "--ppl", "shakespeare", "--seqlen", "64"], f"model {model} is a file")
    proc = run_entry("estimate.py", ["--model", str(tiny_model_dir / "config.json"), "--deepspeed", "zero3_offload", "--seqlen", "64"])
    assert "the run:" in proc.stdout


def test_an_nvme_path_for_a_config_without_nvme_is_refused(tmp_path, tiny_model_dir):
    """A new user's walk (2026-12-02): --nvme_path with zero3_offload ran to the end with everything in host memory, the
    resolved config printing the path as if used."""
    _prune_fails(["--deepspeed", "zero3_offload", "--model", str(tiny_model_dir), "--nvme_path", str(tmp_path),
                  "--output_dir", str(tmp_path / "o")], f"--nvme_path {tmp_path} is given, but this DeepSpeed config "
                 "offloads nothing to NVMe", "use ds_configs/zero3_nvme.json")
    assert not (tmp_path / "o").exists()


def test_an_nvme_folder_without_direct_io_is_refused_before_the_model_loads(tmp_path, tiny_model_dir, text_dir):
    """An audit (file systems, 2026-12-07): an NVMe folder on a file system that refuses O_DIRECT (ramfs here; tmpfs
    before Linux 6.6, many FUSE and network file systems) was refused as 0 bytes free, and past --ignore_memory_check
    was DeepSpeed's AssertionError ("open for write failed ... error = 22") after the model had loaded."""
    with mounted(tmp_path / "ram", "-t", "ramfs", "ramfs") as ram:
        (ram / "nv").mkdir()
        _prune_fails(["--deepspeed", "zero3_nvme", "--model", str(tiny_model_dir), "--seqlen", "64", "--nvme_path", str(ram / "nv"),
                      "--dataset", str(text_dir), "--ignore_memory_check", "--output_dir", str(tmp_path / "o")],
                     f"NVMe path {ram / 'nv'} (--nvme_path): its file system", "takes no direct I/O (O_DIRECT)",
                     "pass --nvme_path DIR on a local disk")
        assert list((ram / "nv").iterdir()) == [] and not (tmp_path / "o").exists()


@pytest.mark.parametrize("value, needle", [("triton", "ELSA_DS_LOSS='triton': expected one of auto, chunked, fused"),
                                           ("fused", "ELSA_DS_LOSS=fused, but the Triton loss cannot run here")])
def test_an_elsa_ds_loss_the_job_cannot_honour_is_refused_before_any_work(tmp_path, value, needle):
    """ELSA_DS_LOSS (elsa_ds/loss.py) read by the plan's checks: a value that is not a choice, or ``fused`` on a machine
    where the Triton loss cannot run (this CPU box), one line and exit 2 before a weight loads, no output made."""
    proc = run_entry("prune.py", ["--deepspeed", "zero3_offload", "--steps", "4", "--interval", "2", "--output_dir",
                                  str(tmp_path / "out")], check=False, env={"ELSA_DS_LOSS": value}, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert needle in errors[0] and not (tmp_path / "out").exists(), errors[0]
    assert "DeepSpeed config" not in proc.stdout
    if value == "triton":  # the evaluation entry point reads it too (its perplexity's rows): refused before loading
        proc = run_entry("evaluate.py", ["--model", "google/gemma-2-2b", "--ppl", str(ROOT / "README.md")], check=False,
                         env={"ELSA_DS_LOSS": value})
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


LAUNCHED_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
NONE_LAUNCHED = dict.fromkeys((*LAUNCHED_ENV, "LOCAL_SIZE", "LOCAL_WORLD_SIZE"))


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "00"}, "RANK='00' is not a count"), ({"RANK": " 0"}, "RANK=' 0'"), ({"RANK": "0\n"}, "RANK='0\\n'"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"), ({"WORLD_SIZE": "-1"}, "WORLD_SIZE='-1'"), ({"MASTER_PORT": "1.5"}, "MASTER_PORT"),
    ({"RANK": None, "LOCAL_RANK": None, "MASTER_ADDR": None, "MASTER_PORT": None, "WORLD_SIZE": "2"}, "WORLD_SIZE set without RANK"),
    ({"LOCAL_RANK": None}, "but LOCAL_RANK is not"), ({"WORLD_SIZE": None, "MASTER_ADDR": ""}, "WORLD_SIZE, MASTER_ADDR are not"),
    ({"RANK": "1"}, "disagree: RANK=1, LOCAL_RANK=0, WORLD_SIZE=1"), ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}, "1 ranks on this node"),
    ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "3"}, "3 ranks on this node"),
    ({"RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, "disagree"),
    ({"MASTER_PORT": "99999"}, "is not a TCP port"), ({"MASTER_PORT": "0"}, "is not a TCP port"),
    ({"MASTER_ADDR": "10.0.0.1 10.0.0.2"}, "holds a space"),
    ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_SIZE=8 (deepspeed's)"),
])
def test_launcher_variables_no_launcher_writes_are_one_line_before_any_work(monkeypatch, env, needle):
    """An audit (2026-12-06): RANK=00 was rank 0 to torch but another rank to the output's lock (a second job wrote into a
    locked output); a stray RANK=1 a job that did nothing and exited 0; RANK without LOCAL_RANK DeepSpeed's KeyError after
    the warm start; WORLD_SIZE=0 a ZeroDivisionError. The variables as deepspeed and torchrun set them pass."""
    from elsa_ds import launch_env

    for key, value in {**NONE_LAUNCHED, **LAUNCHED_ENV, **env}.items():
        monkeypatch.delenv(key, raising=False) if value is None else monkeypatch.setenv(key, value)
    said = launch_env.problem()
    assert said is not None and needle in said and ("deepspeed" in said or "port" in said or "host" in said), said
    # what launchers write (a review, 2026-12-06): deepspeed over nodes of uneven slots, torchrun (its virtual local
    # rank too), a Kubeflow PyTorchJob pod (no LOCAL_RANK: enough for a one-shot job, whose rank 0 works alone)
    for launcher, group in (({"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "12", "LOCAL_SIZE": "4"}, True),
                            ({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, True),
                            ({"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, True),
                            ({"RANK": "2", "LOCAL_RANK": None, "WORLD_SIZE": "4"}, False)):
        for key, value in {**NONE_LAUNCHED, **LAUNCHED_ENV, **launcher}.items():
            monkeypatch.delenv(key, raising=False) if value is None else monkeypatch.setenv(key, value)
        assert launch_env.problem(group) is None and launch_env.rank() == int(launcher["RANK"]), launcher
    assert launch_env.local_size(4) == 4 and launch_env.problem(group=True) is not None  # the pod's set, for the engine
    for key in NONE_LAUNCHED:  # a plain `python` run: nothing set, nothing wrong
        monkeypatch.delenv(key, raising=False)
    assert launch_env.problem() is None and (launch_env.rank(), launch_env.world_size(), launch_env.launched()) == (0, 1, False)


def test_a_malformed_rank_is_refused_by_the_job_and_named_plainly_by_the_error_path(tmp_path, monkeypatch):
    """The job's refusal comes before the output's lock (RANK=00 had skipped it and written anyway); the logger and the
    error path take a value they cannot read as rank 0 of one (RANK=abc had made even `--help` a ValueError traceback)."""
    from elsa_ds import launch_env
    from elsa_ds.errors import first_to_say
    from elsa_ds.log import get_logger

    proc = run_entry("prune.py", ["--deepspeed", "zero3_offload", "--method", "magnitude", "--output_dir", str(tmp_path / "out")],
                     check=False,
                     env={**LAUNCHED_ENV, "RANK": "00"}, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1 and "RANK='00'" in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    for key, value in {"RANK": "abc", "WORLD_SIZE": "abc", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert first_to_say("a line") and launch_env.rank() == 0 and not launch_env.launched()
    get_logger("tests.launch_env").info("readable")


@pytest.mark.parametrize("name, value, needle", [
    ("ELSA_DS_COMPILED", "abc", "choose 1 or true or on or yes or 0"), ("ELSA_DS_KERNELS", "disable", "ELSA_DS_KERNELS='disable'"),
    ("ELSA_DS_SPARSE_LOOPS", "avx-512", "portable or avx512"), ("ELSA_DS_CPU_BF16", "true", "choose 1 or 0"),
    ("ELSA_DS_KEEP_SWAP_FILES", "yes", "choose 1 or 0"), ("ELSA_DS_FUSE_SIBLINGS", "yes", "choose 1 or 0"),
    ("ELSA_DS_GPU_LAYOUT", "csr", "cols16 or delta8"), ("ELSA_DS_PHASE_LOG", "{tmp}", "name a file"),
    ("ELSA_DS_PHASE_LOG", "{tmp}/no/such/phases.jsonl", "in a folder that exists"), ("TORCH_EXTENSIONS_DIR", "{tmp}/f", "not a folder"),
])
def test_a_switch_in_the_environment_that_its_reader_would_ignore_is_said_first(tmp_path, monkeypatch, name, value, needle):
    """An audit (2026-12-06): ELSA_DS_COMPILED=abc turned the opt-in path on, ELSA_DS_KERNELS=disable left the kernels on,
    ELSA_DS_SPARSE_LOOPS=avx-512 was ignored; a folder as the phase log, a file as torch's build folder were tracebacks."""
    from elsa_ds.plan.switches import CHOICES, switch_problem
    from elsa_ds.sparse.kernels import LOOPS_ENV
    from elsa_ds.sparse.linear import COLS16, DELTA8, GPU_LAYOUT_ENV
    from elsa_ds.sparse.siblings import FUSE_ENV

    assert CHOICES[LOOPS_ENV] == ("portable", "avx512") and CHOICES[GPU_LAYOUT_ENV] == (COLS16, DELTA8) and FUSE_ENV in CHOICES
    (tmp_path / "f").write_text("")
    monkeypatch.setenv(name, value.format(tmp=tmp_path))
    assert needle in (switch_problem() or ""), switch_problem()
    monkeypatch.setenv(name, {"ELSA_DS_PHASE_LOG": str(tmp_path / "phases.jsonl"), "TORCH_EXTENSIONS_DIR": str(tmp_path),
                              "ELSA_DS_SPARSE_LOOPS": " Portable", "ELSA_DS_GPU_LAYOUT": "delta8"}.get(name, "0"))
    assert switch_problem() is None
    monkeypatch.setenv(name, "")  # empty: the reader's default, as unset (a review: refused at first)
    assert switch_problem() is None


def test_deepspeed_s_timeout_that_its_import_cannot_read_is_said_before_it(tmp_path, monkeypatch):
    """DEEPSPEED_TIMEOUT is int() of it at DeepSpeed's import, in minutes: ``abc`` (or empty) was a ValueError's traceback
    from inside the plan's checks, 0 a rendezvous and collectives that time out at once."""
    from elsa_ds.plan.switches import switch_problem

    proc = run_entry("prune.py", ["--deepspeed", "zero3_offload", "--method", "magnitude", "--output_dir", str(tmp_path / "out")],
                     check=False, env={"DEEPSPEED_TIMEOUT": "abc"}, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1 and "DEEPSPEED_TIMEOUT='abc'" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    proc = run_entry("estimate.py", ["--deepspeed", "zero3_offload"], check=False, env={"DEEPSPEED_TIMEOUT": "abc"}, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "DEEPSPEED_TIMEOUT='abc'" in proc.stderr, proc.stderr
    # elsa-evaluate never imports DeepSpeed: its value is none of its business (a review), its own switches are
    proc = run_entry("evaluate.py", ["--model", str(tmp_path)], check=False, env={"DEEPSPEED_TIMEOUT": "abc"}, timeout=300)
    assert proc.returncode == 2 and "DEEPSPEED_TIMEOUT" not in proc.stderr and "has no config.json" in proc.stderr, proc.stderr
    for value, refused in (("", True), ("0", True), ("-5", True), ("1.5", True), ("1", False), (" 30", False)):
        monkeypatch.setenv("DEEPSPEED_TIMEOUT", value)
        assert ("whole number of at least 1" in (switch_problem() or "")) == refused, value


def test_the_switches_are_said_before_a_job_s_work_and_before_a_sparse_checkpoint_loads(tmp_path, monkeypatch):
    """Through the real entry point (before the plan's other checks), and from_pretrained before it reads the folder
    (ELSA_DS_FUSE_SIBLINGS=yes was said after the whole load and its checksums)."""
    from elsa_ds.sparse import from_pretrained
    from elsa_ds.sparse.integrity import SparseArgumentError

    proc = run_entry("prune.py", ["--deepspeed", "zero3_offload", "--method", "magnitude", "--output_dir", str(tmp_path / "out")],
                     check=False, env={"ELSA_DS_COMPILED": "abc"}, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1 and "ELSA_DS_COMPILED='abc'" in errors[0], proc.stderr
    assert not (tmp_path / "out").exists()
    for name, value in (("ELSA_DS_FUSE_SIBLINGS", "yes"), ("ELSA_DS_SPARSE_LOOPS", "avx-512")):
        monkeypatch.setenv(name, value)
        with pytest.raises(SparseArgumentError, match=name):
            from_pretrained(tmp_path / "no such checkpoint", mode="sparse")
        monkeypatch.delenv(name)
