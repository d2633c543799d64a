"""One training cell of the quality benches without DeepSpeed: the same job on one device in a plain PyTorch loop.

    python bench/plain_cell.py [--device auto|cpu|cuda] <launch/prune.py's flags for an ELSA or --finetune full run>

Why: on one GPU a small model's ZeRO-3 step is the host's work (hooks, gathers, Python), not the GPU's: Gemma-3 270M
stepped 8 x 512 tokens in ~0.5-0.6 s on an H200 whose matmuls need ~20 ms, so the budget curve's longest cells (2048
steps) do not fit a 15-minute loan. The method does not need the engine; this loop runs the job's own parts around it:

- the settings as ``launch/prune.py`` resolves them (the same flags, the defaults rule, the DeepSpeed JSON's batch split,
  gradient clipping and dtype: ``elsa_ds.plan.make_plan``), the same global batches (``elsa_ds.jobs.training.load_data``),
  the same chunked loss, learning-rate schedule and one-shot starts (``prune_oneshot`` on the values rounded to the
  engine's dtype, as ``warm_start.oneshot_on_rank0``);
- the same optimizers: ``AdmmOptimizer`` (ELSA) or ``MaskedOptimizer`` (retraining; none: the dense control) over the
  base optimizer the job builds (``zero/engine.base_optimizer``: torch's Adam where the optimizer stays on the device,
  DeepSpeedCPUAdam under offload, on the host only; 8-bit Adam, ELSA-L's, is refused);
- DeepSpeed's bf16 arithmetic: the model's weights, forward, backward and accumulated gradients in the engine's dtype,
  fp32 masters that the optimizer steps, clipped by their global norm as ZeRO-3 computes and applies it
  (:func:`clip_as_zero3`), copied back to the weights after each step.

What differs from the engine: no partitioning, offload, checkpoints, validation or resume (refused: a cell is one short
run). On one rank it trains the engine's weights bit for bit in bf16 (``tests/test_bench_plain_cell.py``: ELSA from a
warm start, retraining, the dense control; with and without optimizer offload); in fp32 its ELSA is
``elsa_ds/reference.py``'s to the bit. Writes the model (the engine's export dtype) and ``elsa_report.json`` with the keys the benches read
(``bench/device/curve.py``'s ``run_cell``), ``"engine": "plain"`` among them.
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import record_function  # noqa: E402

from elsa_ds.admm.optimizer import AdmmOptimizer, summarize_metrics  # noqa: E402
from elsa_ds.admm.projection import Slice, keep_count  # noqa: E402
from elsa_ds.admm.schedule import learning_rate  # noqa: E402
from elsa_ds.errors import ElsaError  # noqa: E402
from elsa_ds.finetune.optimizer import MaskedOptimizer  # noqa: E402
from elsa_ds.loss import next_token_loss  # noqa: E402
from elsa_ds.loss import taken as loss_taken  # noqa: E402
from elsa_ds.targets import goal_ratio, select_targets  # noqa: E402
from elsa_ds.torch_api import compile_counts, compile_errors_run_eagerly, foreach_copy_, foreach_mul_, foreach_norm  # noqa: E402

UNSUPPORTED = ("resume", "random_init", "select_every")
COMPILE_BACKENDS = ("none", "inductor", "aot_eager")


def parse(argv: list[str]):
    """(the device, the job's Plan): the flags resolved as ``launch/prune.py`` resolves them; ElsaError, before any work,
    for what this loop does not run."""
    from elsa_ds.cli import prune_parser, settings_from_args
    from elsa_ds.plan import make_plan

    own = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    own.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    own.add_argument("--compile", choices=COMPILE_BACKENDS, default="none",
                     help="torch.compile the model's forward and backward with this backend (inductor: fused kernels, fewer "
                          "launches a step; aot_eager: the same capture without code generation, for checks); a graph "
                          "that does not compile runs eagerly [none]")
    args, rest = own.parse_known_args(argv)
    opts, cfg, ds_config = settings_from_args(prune_parser().parse_args(rest))
    trains = cfg.oneshot is None or cfg.finetune is not None
    if not trains or cfg.finetune is not None and cfg.finetune.value != "full":
        raise ElsaError("bench/plain_cell.py runs ELSA or --finetune full; run anything else with launch/prune.py")
    if cfg.base_optimizer.value not in ("auto", "adam", "cpu_adam"):  # DeepSpeedCPUAdam: Adam's arithmetic on the host
        raise ElsaError(f"bench/plain_cell.py steps torch's fp32 Adam, not --base_optimizer {cfg.base_optimizer.value}")
    given = [k for k in UNSUPPORTED if getattr(cfg, k, None) or getattr(opts, k, None)]
    if given or cfg.val_windows:
        raise ElsaError(f"bench/plain_cell.py runs one short cell: {', '.join(given) or 'val_windows'} not supported")
    plan = make_plan(cfg, opts, ds_config)  # the defaults rule and the job's checks
    device = torch.device("cuda" if args.device == "cuda" or args.device == "auto" and torch.cuda.is_available() else "cpu")
    host_adam = cfg.base_optimizer.value == "cpu_adam" or cfg.base_optimizer.value == "auto" and plan.ds.optimizer_offloaded
    if device.type == "cuda" and host_adam:
        raise ElsaError(f"{plan.ds.source} offloads the optimizer (DeepSpeedCPUAdam steps host tensors) but this loop's masters "
                        "are on the GPU: pass a config that keeps it there (ds_configs/zero3.json) or --device cpu")
    return device, plan, args.compile


def compile_model(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    """What the steps call: the model, or its forward (and through AOTAutograd its backward) compiled by ``backend`` on
    the first call (``torch.compile``'s wrapper: the model itself, its weights' names and so its export, unchanged;
    ``nn.Module.compile`` compiled nothing in torch 2.13, its ``_call_impl`` is in a file dynamo skips). Shapes static, as
    every step's are. A graph the backend cannot compile runs eagerly instead (``suppress_errors``; the backward compiled
    with the forward, so its failure falls back too): the cell goes on, its report says how many graphs compiled
    (:func:`compile_report`). On a GPU whose step is the host's (Gemma-3 270M at 8 x 512: ~7,200
    launches, ~0.2 s of host time a step) the fused graphs are the lever; the numbers differ from eager's in the last
    bits (fused arithmetic), so a budget's cells compare within one loop (the key's ``|compiled``)."""
    if backend == "none":
        return model
    compile_errors_run_eagerly()
    return torch.compile(model, backend=backend, dynamic=False)  # type: ignore[return-value]


def compile_report(backend: str, times: list[float]) -> dict:
    """What the compile did, for the cell's report: its backend, the graphs it compiled (0: it ran eagerly), the graph
    breaks, and the first step's seconds (the compile's time is in it)."""
    if backend == "none":
        return {"compile": None}
    graphs, breaks = compile_counts()
    return {"compile": backend, "compiled_graphs": graphs, "graph_breaks": breaks, "first_step_s": times[0] if times else None}


def starting_point(plan, tokenizer, dtype: torch.dtype):
    """(the model the run starts from, in ``dtype`` on the host; its keep-masks by weight name or None; the one-shot's
    seconds): a one-shot start as the engine's jobs compute it, or the dense weights."""
    from elsa_ds.files.mask_file import MaskReader
    from elsa_ds.methods import OneShot
    from elsa_ds.models import ModelSource
    from elsa_ds.oneshot.pipeline import load_host_model, prune_oneshot, round_to, saved_dtype

    cfg = plan.cfg
    start = cfg.oneshot.value if cfg.finetune is not None and cfg.oneshot is not None else cfg.init_mask
    if start is None:
        return plan.source.load(dtype), None, 0.0
    if start not in {m.value for m in OneShot}:  # a pruned folder: its zeros are the masks
        masks = MaskReader(start)
        model = (ModelSource(start) if cfg.init_weights else plan.source).load(dtype)
        return model, {name: masks.read(name, 0, masks.numel(name)) for name in masks.shapes}, 0.0
    model = load_host_model(plan.source)
    round_to(model, saved_dtype(plan.ds.raw))  # the values the engine holds: the one-shot decides on those (the jobs' rule)
    done = prune_oneshot(cfg, OneShot(start), tokenizer, model)
    model = plan.source.load(dtype)  # loaded as the engine loads it: cast with .to(dtype), the host copy would take its
    # buffers along (Gemma's rotary inv_freq in bf16, not fp32: another forward, 0.1 % of a 500-step cell's perplexity)
    if cfg.finetune is not None or cfg.init_weights:
        model.load_state_dict(done.model.state_dict())
    return model, {name: m.reshape(-1) for name, m in done.masks.items()}, done.seconds


def optimizer(plan, model: torch.nn.Module, masks: dict[str, torch.Tensor] | None):
    """(the optimizer, its fp32 masters paired with the weights they update; the ADMM wrapper or None)."""
    cfg = plan.cfg
    from elsa_ds.zero.engine import base_optimizer

    pairs = [(p.detach().float().clone(), p) for p in model.parameters() if p.requires_grad]
    masters = [m for m, _ in pairs]
    base = base_optimizer(cfg, masters, plan.ds)  # the job's own: torch's Adam (its own choice of loop), or DeepSpeedCPUAdam
    pruned = select_targets(model, cfg.targets)
    named = {id(p): m for m, p in pairs}
    shapes = {name: tuple(p.shape) for p in model.parameters() if (name := pruned.get(id(p)))}
    goals = cfg.layer_goals(shapes)

    def initial_mask(sl: Slice) -> torch.Tensor:
        assert masks is not None
        return masks[sl.layer][sl.start:sl.start + sl.length]

    if cfg.finetune is not None:
        if masks is None:  # the dense control
            return base, pairs, None
        opt: torch.optim.Optimizer = MaskedOptimizer(base, initial_mask)
        admm = None
    else:
        opt = admm = AdmmOptimizer(base, cfg.admm_settings())
        if masks is not None:
            admm.initial_mask = initial_mask
    for pid, name in pruned.items():
        flat = named[pid]
        opt.assign(flat, [Slice(name, 0, flat.numel(), 0, flat.numel(), keep_count(flat.numel(), goal_ratio(goals[name])))])
    return opt, pairs, admm


def clip_as_zero3(masters: list[torch.Tensor], clip: float, offloaded: bool, sub_group_size: float) -> None:
    """Scale the ``masters``' gradients (fp32, the optimizer's order) down to a global 2-norm of ``clip`` as ZeRO-3 does
    on one rank (DeepSpeed 0.19's stage3.py), so that the masters get the engine's values to the bit: the parameters cut
    into sub-groups of at least ``sub_group_size`` entries (``_create_fp16_sub_groups``); each gradient's norm in fp64 and
    a sub-group's the root of their squares' sum (``get_grad_norm_direct``; under optimizer offload each gradient's norm
    from 250M-entry chunks and the sum rounded to fp32 before its root: ``_constant_buffered_norm2``,
    ``complete_grad_norm_calculation_for_cpu_offload``); the sub-groups' 2-norm (``combine_grad_norm_groups``); every
    gradient times 1 / max(1, (norm + 1e-6) / clip) (``unscale_and_clip_grads``). torch's ``clip_grad_norm_`` (fp32 norms,
    times clip / (norm + 1e-6)) differs in the last bits, which bf16 weights carry on: on the demo 0.036 % of the weights
    were a bf16 ulp apart after two steps (docs/results.md 1.4)."""
    groups: list[list[torch.Tensor]] = []
    if sub_group_size >= sum(m.numel() for m in masters):
        groups.append(masters)
    else:
        group: list[torch.Tensor] = []
        size = 0
        for m in masters:
            group.append(m)
            size += m.numel()
            if size >= sub_group_size or m is masters[-1]:
                groups.append(group)
                group, size = [], 0
    norms = []
    for members in groups:
        grads = [m.grad for m in members if m.grad is not None]
        if not grads:
            continue
        if offloaded:
            total = 0.0
            for g in grads:
                norm = None
                for part in g.reshape(-1).split(250_000_000):
                    norm = part.to(torch.float64).norm(2) ** 2.0 if norm is None else norm + part.to(torch.float64).norm(2) ** 2.0
                total += (norm ** 0.5) ** 2
            norms.append(torch.tensor([float(total)], dtype=torch.float32, device=grads[0].device)[0] ** 0.5)
        else:  # one multi-tensor launch for the sub-group's norms (fp64: on CPU each the cast gradient's norm to the bit)
            norms.append(torch.sum(torch.pow(torch.stack(foreach_norm(grads, torch.float64)), 2.0)) ** 0.5)
    if not norms:
        return
    scale = torch.clamp((torch.linalg.vector_norm(torch.stack(norms), ord=2) / 1.0 + 1e-6) / clip, min=1.0)
    # the factor in fp32, as mul_ casts a 0-dim fp64 operand for fp32 gradients (the same number): an fp64 one sends
    # torch's multi-tensor mul to its per-tensor path on a GPU (a launch a gradient)
    foreach_mul_([m.grad for m in masters if m.grad is not None], (1.0 / scale).float())


def grads_to_masters(pairs: list[tuple[torch.Tensor, torch.nn.Parameter]]) -> None:
    """Each weight's gradient (the weights' dtype) into its fp32 master's, kept from step to step, in one multi-tensor
    copy (a master whose weight got no gradient gets none). Per tensor, ~240 launches a step for Gemma-3 270M, each
    host time on a GPU whose step is the host's."""
    have = []
    for m, p in pairs:
        if p.grad is None:
            m.grad = None
            continue
        if m.grad is None:
            m.grad = torch.empty_like(m)
        have.append((m.grad, p.grad))
    if have:
        foreach_copy_([g for g, _ in have], [g for _, g in have])


def one_step(model, opt, pairs, micro: list[torch.Tensor], plan, device: torch.device) -> float:
    """One global batch: the micro-batches' gradients summed in the weights' dtype, then the fp32 masters stepped (after
    clipping their global norm as ZeRO-3 does) and copied back. Returns the mean loss (waiting for the device). The spans
    are the engine's step's (``zero/steps.py``), for ``elsa_ds/step_profile.py``."""
    for _, p in pairs:
        p.grad = None
    total = torch.zeros((), dtype=torch.float64, device=device)
    for ids in micro:
        ids = ids.to(device)
        with record_function("elsa_ds.forward"):
            logits = model(input_ids=ids, use_cache=False).logits
        with record_function("elsa_ds.loss"):
            loss = next_token_loss(logits, ids)
        del logits
        with record_function("elsa_ds.backward"):
            (loss / len(micro)).backward()  # the engine's backward divides by the accumulation steps too
        total += loss.detach()
    with torch.no_grad(), record_function("elsa_ds.step"):
        grads_to_masters(pairs)
        if clip := plan.ds.raw.get("gradient_clipping"):
            zero = plan.ds.raw.get("zero_optimization", {})
            clip_as_zero3([m for m, _ in pairs], clip, plan.ds.optimizer_offloaded, float(zero.get("sub_group_size", 1e9)))
        opt.step()
        foreach_copy_([p for _, p in pairs], [m for m, _ in pairs])  # rounded to the weights' dtype, as copy_ rounds
    return float(total) / len(micro)


def train(plan, model, opt, pairs, admm, batches, device: torch.device, mark=lambda phase: None) -> dict:
    """``cfg.steps`` steps; returns the step times (the profiled ones left out, as the jobs leave them), the last loss,
    ADMM's projection log and, with ``ELSA_DS_PROFILE_STEPS`` set, where a step's time went."""
    from elsa_ds.step_profile import StepProfiler

    cfg = plan.cfg
    times, profiled, projections, loss_value = [], [], [], float("nan")
    profiler = StepProfiler.from_env(0)
    model.train()
    try:
        for step in range(cfg.steps):
            profiler.before(step)
            if step < 2:  # the phases as the jobs name them: step 0 (the compile's, the lazy states'), then the rest
                mark("first step" if step == 0 else "step")
            began = time.perf_counter()
            if admm is not None:
                admm.begin_step(step)
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.lr_final_ratio)
            loss_value = one_step(model, opt, pairs, batches.micro_batches(step), plan, device)
            seconds = time.perf_counter() - began
            (profiled if profiler.after(step, seconds) else times).append(seconds)
            if not math.isfinite(loss_value):  # the jobs' train_loop stops there too
                raise ElsaError(f"the loss became {loss_value} at step {step}; the cell stopped there")
            if admm is not None and admm.projected_this_step:
                projections.append(projection(admm, step, loss_value))
            elif step % max(cfg.log_interval, cfg.steps // 50) == 0:  # ~50 lines a run at most
                print(f"[step {step + 1}/{cfg.steps}] loss {loss_value:.4f}, {seconds:.3f} s", flush=True)
    except BaseException:
        profiler.abandon()
        raise
    profiler.close()
    return {"times": times or profiled, "final_loss": loss_value, "projections": projections}


def projection(admm, step: int, loss: float) -> dict:
    """A projection's line, as the ELSA job's report keeps it (λ per layer under the adaptive schedule), printed."""
    spread = admm.lambda_range()
    entry = {"step": step + 1, "loss": loss, "final": admm.finalized_this_step,
             **summarize_metrics(admm.local_metrics(), admm.lambda_now()),
             **({"lambda_range": list(spread)} if spread is not None else {})}
    print(f"[projection] step {step + 1}: loss {loss:.4f}, residual {entry['residual']:.4f}, "
          f"mask flips {entry['mask_flip_frac']:.4%}", flush=True)
    return entry


def check_sparsity(model: torch.nn.Module, plan, masks: dict[str, torch.Tensor] | None) -> float:
    """The pruned weights' overall sparsity; ElsaError if a layer is off its goal or (retraining) off its mask. The dense
    control (retraining without a mask) has no goal: its measured share of zeros, as its engine job reports it."""
    cfg = plan.cfg
    dense = cfg.finetune is not None and masks is None
    pruned = select_targets(model, cfg.targets)
    weights = {name: p for p in model.parameters() if (name := pruned.get(id(p)))}
    goals = cfg.layer_goals({name: tuple(w.shape) for name, w in weights.items()})
    zeros = total = 0
    for name, w in weights.items():
        kept = int(torch.count_nonzero(w))
        goal = keep_count(w.numel(), goal_ratio(goals[name]))
        if not dense and (kept > goal or masks is not None and cfg.finetune is not None
                          and bool((w.reshape(-1).cpu() != 0)[~masks[name]].any())):
            raise ElsaError(f"{name}: {kept} entries kept against the goal's {goal}" + (" or off its mask" if masks else ""))
        zeros, total = zeros + w.numel() - kept, total + w.numel()
    return zeros / max(total, 1)


def build_and_publish(plan, device: torch.device, out: Path, started: float, backend: str = "none") -> dict:
    """The cell under the output's lock: the starting point, the training, the model and its report written into a
    staging folder of this process (``fresh_staging``) and swapped in for ``out`` (``publish``); its report."""
    from elsa_ds.files.disk_room import disk_full
    from elsa_ds.files.io import write_json
    from elsa_ds.files.output import fresh_staging, publish
    from elsa_ds.jobs.phases import PhaseLog
    from elsa_ds.jobs.training import load_data
    from elsa_ds.oneshot.pipeline import saved_dtype
    from elsa_ds.zero.engine import model_dtype

    cfg = plan.cfg
    torch.manual_seed(cfg.seed)
    phases = PhaseLog(0)  # where a cell's time goes, as the jobs mark it (ELSA_DS_PHASE_LOG: the runner's phase_s)
    phases.mark("data")
    data = load_data(plan, 0, 1)
    phases.mark("load")  # the model, and a one-shot start's pass (the report's prune_s)
    dtype = model_dtype(plan.ds.raw)
    model, masks, oneshot_s = starting_point(plan, data.tokenizer, dtype)
    if cfg.freeze_embeddings:
        from elsa_ds.models import freeze_embeddings

        freeze_embeddings(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.to(device)
    forward = compile_model(model, backend)
    opt, pairs, admm = optimizer(plan, model, masks)
    trained = train(plan, forward, opt, pairs, admm, data.batches, device, phases.mark)
    phases.mark("export")
    sparsity = check_sparsity(model, plan, masks)
    staging = fresh_staging(out)  # written whole, then swapped in: never half a model under out, nothing left on a failure
    try:
        model.to(saved_dtype(plan.ds.raw)).save_pretrained(staging)
        data.tokenizer.save_pretrained(staging)
        steps = trained["times"][1:] or trained["times"]
        report = {"engine": "plain", "device": str(device), "method": cfg.method.value, "config": cfg.model_dump(mode="json"),
                  "defaults": plan.defaults, "step_time_s": sum(steps) / len(steps), "final_loss": trained["final_loss"],
                  "overall_sparsity": sparsity, "prune_s": oneshot_s, "projections": trained["projections"],
                  "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,  # the one-shot's too,
                  # as the job's report counts it
                  "wall_s": round(time.time() - started, 1), "loss_path": loss_taken(), **compile_report(backend, trained["times"])}
        write_json(staging / "elsa_report.json", report)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        full = disk_full(err, staging) if isinstance(err, Exception) else None  # OSError, safetensors' wrapped one
        if full is not None:  # one line, as the jobs say it
            raise full from None
        raise
    publish(staging, out, keep_checkpoints=False, carry=())  # the previous output (--overwrite) goes only once this is in
    phases.mark("done")
    return report


def main(argv: list[str] | None = None) -> int:
    from elsa_ds.files.output import check_output_dir
    from elsa_ds.files.ownership import owned

    started = time.time()
    try:
        device, plan, backend = parse(sys.argv[1:] if argv is None else argv)
    except ElsaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg, out, opts = plan.cfg, Path(plan.opts.output_dir), plan.opts
    try:
        with owned(out, "--output_dir"):  # a second cell on the same output is refused, as a job is
            check_output_dir(out, opts.overwrite)  # again under the lock: another job may have published there since
            report = build_and_publish(plan, device, out, started, backend)
    except ElsaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"plain cell: {cfg.steps} steps, {report['step_time_s']:.3f} s a step, final loss {report['final_loss']:.4f}, "
          f"sparsity {report['overall_sparsity']:.4f} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
