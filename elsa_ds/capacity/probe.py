"""A small CPU job's forward and backward timed on this machine, in a real ZeRO-3 engine, for ``elsa-estimate --measure``.

On a CPU host the parts of a small job's step that a copy rate and a matmul rate cannot price are most of it: the
model runs far below the matmul rate (attention, norms, the framework's per-operation work); every parameter tensor
costs ZeRO-3 fixed work whatever its size (DeepSpeed's hooks fetch and release it around the forward and the backward,
its gradient is reduced and handed on, each a gloo collective on loopback); and the ranks share the host's cores
(DeepSpeed's launcher pins no threads, so each rank's torch takes every core: 2 ranks on 2 cores ran the demo model's
forward and backward in 0.7 s together, 0.21 s with a thread each, and the job's engine in 0.40 s, its waits between
the two). A fixed per-tensor figure fitted on one machine missed another of the same core count by 25-30 %
(2026-11-30, docs/results.md).

:func:`measure_job` therefore runs the job's own micro-step where it is cheap (a model of at most
:data:`TIMED_MODEL_PARAMS` parameters, every rank of a CPU job on this host): the job's ranks as child processes (gloo,
as DeepSpeed's CPU accelerator runs them), each building the job's model (its config, random weights) in a real ZeRO-3
engine under the job's DeepSpeed settings (NVMe devices replaced by the host: NVMe traffic is priced from its bytes;
the plain base optimizer: ELSA's step is priced from DeepSpeedCPUAdam's measured rate), and times the forward and the
backward of one micro-batch of the job's tokens, gradient checkpointing as the job sets it. The estimate takes that
in place of the micro-step's modelled compute and per-tensor work. Larger models and GPU jobs keep the rates'
pricing. Run as a module this file is one probe rank (the launcher's variables set).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from elsa_ds.errors import run_command
from elsa_ds.files.io import write_json
from elsa_ds.files.procfs import usable_cpus
from elsa_ds.log import get_logger
from elsa_ds.zero import compat
from elsa_ds.zero.dist import free_port

log = get_logger(__name__)

TIMED_MODEL_PARAMS = 200_000_000  # a larger CPU job's step is its matmuls, which the matmul rate prices
PROBE_STEPS, PROBE_WARMUP = 8, 3
PROBE_STEP_BUDGET_S = 3.0         # a micro-step longer than this (its FLOPs at the matmul rate) is priced, not timed
TIMEOUT_S = 300                   # DeepSpeed's import, the engines and a few micro-steps, on 2 busy cores
ANSWER_GRACE_S = 10.0             # rank 0's last step and its answer's write, once another rank has died at exit


@dataclass(frozen=True)
class JobTimings:
    """One micro-step's forward and backward of the job in a ZeRO-3 engine on this host's ranks, and the engine's step
    (rank 0's, the median of :data:`PROBE_STEPS` after :data:`PROBE_WARMUP`: one step slowed by another process on a
    small host does not move it), seconds; ``ranks``: how many ran at once."""

    forward_s: float
    backward_s: float
    step_s: float  # the engine's step with the plain base optimizer (DeepSpeedCPUAdam offloaded, else torch's Adam)
    ranks: int

    @property
    def micro_step_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict:
        return {**asdict(self), "micro_step_s": self.micro_step_s}


def measure_job(shape, ds: dict, cfg, num_gpus: int, num_nodes: int, device: str, flop_rate: float) -> JobTimings | None:
    """The job's micro-step timed here (module docstring), or None where it is not: a GPU job, a job of several nodes
    (their collectives cross a network this host cannot time), more ranks than this host has CPUs, a model past
    :data:`TIMED_MODEL_PARAMS` or whose micro-step would take past :data:`PROBE_STEP_BUDGET_S` at ``flop_rate`` (the
    node's matmul FLOP/s, shared by its ranks), or ranks that cannot run here (a line says why)."""
    from elsa_ds.capacity.memory import model_config

    if device != "cpu" or num_nodes != 1 or shape.num_params > TIMED_MODEL_PARAMS:
        return None
    flops = 6 * shape.num_params * int(ds["train_micro_batch_size_per_gpu"]) * cfg.seqlen * num_gpus
    if (priced := flops / flop_rate) > PROBE_STEP_BUDGET_S:
        log.info(f"the job's micro-step is not timed here: {priced:.1f} s at {flop_rate / 1e9:.0f} GFLOP/s, past "
                 f"{PROBE_STEP_BUDGET_S:g} s; the rates price it")
        return None
    if num_gpus > (cpus := usable_cpus()):
        log.info(f"the job's micro-step is not timed here: {num_gpus} ranks on {cpus:g} usable CPUs; the rates price it")
        return None
    with tempfile.TemporaryDirectory(prefix="elsa_probe_") as folder:
        model_config(cfg.model).save_pretrained(folder)  # as the estimate resolved it (offline): the ranks build from it
        spec = {"model": folder, "seqlen": cfg.seqlen, "checkpointing": bool(cfg.gradient_checkpointing),
                "freeze_embeddings": bool(cfg.freeze_embeddings), "leaf_layers": bool(cfg.leaf_layers),
                "ds": _probe_config(ds, num_gpus),
                "answer": str(Path(folder) / "timed.json")}
        return _run_ranks(num_gpus, spec)


# what the probe's engine leaves out of the job's DeepSpeed config: the optimizer and schedule it brings itself (and
# elsa_ds refuses in a config), what writes files, and ELSA's own block; the batch and ZeRO sections it sets
LEFT_OUT = ("optimizer", "scheduler", "elsa", "checkpoint", "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
            "autotuning", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization")


def _probe_config(ds: dict, world: int) -> dict:
    """The job's DeepSpeed settings for one micro-batch a step, offload to NVMe taken to the host (its traffic is priced
    from its bytes), nothing that writes files (:data:`LEFT_OUT`)."""
    zero = dict(ds.get("zero_optimization", {}))
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key) or {}
        if section.get("device", "none") == "nvme":
            zero[key] = {"device": "cpu", "pin_memory": bool(section.get("pin_memory", False))}
    micro = int(ds["train_micro_batch_size_per_gpu"])
    kept = {k: v for k, v in ds.items() if k not in LEFT_OUT}
    return {**kept, "train_batch_size": micro * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False}


def _rank_main(spec: dict) -> None:
    import deepspeed
    import torch

    from elsa_ds.loss import next_token_loss
    from elsa_ds.models import ModelSource, as_transformers, freeze_embeddings
    from elsa_ds.zero.dist import init_distributed
    from elsa_ds.zero.ds_config import DsConfig
    from elsa_ds.zero.engine import load_partitioned

    rank, _ = init_distributed()  # the job's own: DeepSpeed's /dev/shm buffer unlinked, the group torn down at exit
    ds = DsConfig(spec["ds"])
    torch.manual_seed(0)
    partitioned = load_partitioned(ModelSource(spec["model"]), ds, spec["checkpointing"], random_init=True,
                                   leaf_layers=spec["leaf_layers"])
    model = partitioned.model.train()
    if spec["freeze_embeddings"]:
        freeze_embeddings(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if ds.optimizer_offloaded:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(params, lr=1e-6)
    else:
        optimizer = torch.optim.Adam(params, lr=1e-6)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds.raw)
    vocab = as_transformers(model).config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (int(ds.raw["train_micro_batch_size_per_gpu"]), spec["seqlen"]))
    forward, backward, stepped = [], [], []
    for step in range(PROBE_WARMUP + PROBE_STEPS):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = next_token_loss(engine(input_ids=ids, use_cache=False).logits, ids)  # the job's own (zero/steps.py)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        if step >= PROBE_WARMUP:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            stepped.append(time.perf_counter() - t2)
    if rank == 0:  # whole or absent: a rank that dies at exit after this (gloo's threads) leaves it standing
        timed = {"forward_s": statistics.median(forward), "backward_s": statistics.median(backward),
                 "step_s": statistics.median(stepped)}
        write_json(Path(spec["answer"]), timed)


def _run_ranks(ranks: int, spec: dict) -> JobTimings | None:
    """``spec``'s micro-step timed in ``ranks`` processes of this host on DeepSpeed's CPU accelerator (whatever GPU the
    host has), in the probe's folder; None, and a line saying why, when one fails (the rest are stopped then, each with
    whatever it started: a compiler mid-build too), when they cannot start, or when no answer comes in :data:`TIMEOUT_S`.
    DeepSpeed's CPU ops are built here first, so that no rank is stopped inside a build and leaves its lock behind."""
    folder = Path(spec["answer"]).parent
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks),
           "LOCAL_SIZE": str(ranks), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "elsa_ds.capacity.probe", json.dumps(spec)]
    procs: list[subprocess.Popen] = []
    why: str | None = None
    failed: int | str | None = None
    try:
        compat.build_cpu_ops()
        for r in range(ranks):
            with (folder / f"rank{r}.err").open("wb") as errors:
                procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=folder,
                                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
                                              start_new_session=True))
        failed = _wait_all(procs, Path(spec["answer"]))
    except (OSError, RuntimeError) as err:  # a process that cannot start, an op that cannot build
        why = f"{type(err).__name__}: {err}"
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the rank and what it started
            p.wait()
    if why is None and isinstance(failed, int):
        said = (folder / f"rank{failed}.err").read_text(errors="replace").split("\n")
        why = next((line.strip()[:200] for line in reversed(said) if line.strip()), f"rank {failed} failed")
        if Path(spec["answer"]).is_file():  # rank 0 timed every step with every rank: one died at exit, not before
            log.debug(f"probe rank {failed} failed after rank 0's answer ({why}); the answer stands")
            why = None
    elif why is None and isinstance(failed, str):
        why = failed
    if why is None:
        try:
            found = json.loads(Path(spec["answer"]).read_text())
            return JobTimings(forward_s=float(found["forward_s"]), backward_s=float(found["backward_s"]),
                              step_s=float(found["step_s"]), ranks=ranks)
        except (OSError, ValueError, KeyError, TypeError) as err:
            why = f"rank 0 left no answer: {err}"
    log.info(f"the job's micro-step could not be timed here ({why}); the rates price it")
    return None


def _wait_all(procs: list[subprocess.Popen], answer: Path) -> int | str | None:
    """None when every process exited 0; the index of the first seen to fail (once rank 0 has had
    :data:`ANSWER_GRACE_S` to write ``answer``: a rank that died at exit may have left it mid-write); a sentence when the
    time ran out."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if (failed := next((i for i, c in enumerate(codes) if c not in (None, 0)), None)) is not None:
            grace = time.monotonic() + ANSWER_GRACE_S
            while procs[0].poll() is None and not answer.is_file() and time.monotonic() < grace:
                time.sleep(0.1)
            return failed
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.2)
    return f"no answer in {TIMEOUT_S} s"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="what measure_job passes: the job's model, tokens and DeepSpeed settings, as JSON")
    spec = json.loads(parser.parse_args().spec)
    run_command(lambda: _rank_main(spec))  # a rank's exit that cannot die in finalization, its answer written
