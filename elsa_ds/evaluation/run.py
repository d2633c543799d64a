"""The evaluation job, start to end: model -> sparsity report -> perplexity -> zero-shot -> one JSON.

``launch/evaluate.py`` only parses arguments and calls ``run``. Evaluation runs in its own process on a
saved model, never inside the pruning job (the ELSA authors' idle ranks hit the collective timeout while
rank 0 ran long zero-shot tasks). Every cheap check (task names, model config, output paths, text
windows) runs before the weights are loaded.
"""
from __future__ import annotations

import contextlib
import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from elsa_ds.data import load_blocks, load_tokenizer
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.perplexity import PROTOCOL, ppl, window_nll
from elsa_ds.evaluation.sparsity import sparsity_report
from elsa_ds.evaluation.tables import results_table, write_atomic
from elsa_ds.evaluation.zeroshot import task_manager, zeroshot

C4_WINDOWS = 256  # SparseGPT/Wanda: the first 1100 validation documents, truncated to 256 x seqlen tokens
NAMED_SOURCES = ("wikitext2", "c4")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class EvalSettings:
    """One evaluation job; the command line maps onto it one to one."""

    model: str
    ppl: list[str] = field(default_factory=list)
    """wikitext2 | c4 | local text file or directory, each evaluated with the same window protocol."""
    tasks: list[str] = field(default_factory=list)
    """lm-eval task names, run 0-shot."""
    include_path: str | None = None
    """Directory of local lm-eval task YAMLs."""
    seqlen: int = 2048
    batch_size: int = 1
    limit: int | None = None
    """Examples per lm-eval task and the most perplexity windows per dataset (for quick checks only)."""
    dtype: str | None = None
    """bf16 | fp16 | fp32; None: bf16 on CUDA, fp32 on CPU."""
    device_map: str | None = None
    """auto: spread a model too big for one GPU over GPUs, CPU and disk (CUDA only)."""
    offload_folder: str | None = None
    """Parent of the temporary disk-offload directory for --device_map auto (default: the system's temp dir)."""
    output: Path | None = None
    markdown: Path | None = None


def check_settings(s: EvalSettings) -> None:
    """Reject bad numbers and unwritable outputs before anything is loaded."""
    if s.seqlen < 2:
        raise ElsaError(f"--seqlen must be at least 2, got {s.seqlen}")
    if s.batch_size < 1:
        raise ElsaError(f"--batch_size must be at least 1, got {s.batch_size}")
    if s.limit is not None and s.limit < 1:
        raise ElsaError(f"--limit must be at least 1, got {s.limit}")
    if s.dtype is not None and s.dtype not in DTYPES:
        raise ElsaError(f"--dtype {s.dtype!r}: use one of {', '.join(DTYPES)}")
    if s.device_map not in (None, "auto"):
        raise ElsaError(f"--device_map {s.device_map!r}: the only choice is 'auto'")
    for flag, path in (("--output", s.output), ("--markdown", s.markdown)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise ElsaError(f"{flag} {path}: directory {Path(path).resolve().parent} does not exist")


def load_config(model_id: str):
    """The model's config, or an ElsaError that says whether a directory or a hub id failed."""
    from transformers import AutoConfig

    path = Path(model_id).expanduser()
    if model_id.startswith((".", "/", "~")) and not path.exists():
        raise ElsaError(f"--model {model_id}: no such directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ElsaError(f"--model {model_id}: directory has no config.json (not a saved transformers model)")
    try:
        return AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError) as err:
        raise ElsaError(f"--model {model_id}: cannot load its config ({str(err).splitlines()[0]})") from None


def load_model(s: EvalSettings, config, offload_folder: str | None) -> torch.nn.Module:
    """from_pretrained in the chosen dtype; eager attention for Gemma-2 (sdpa drops the logit soft-capping)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": resolve_dtype(s.dtype)}
    if config.model_type == "gemma2":
        kwargs["attn_implementation"] = "eager"
    if torch.cuda.is_available():
        kwargs["device_map"] = "auto" if s.device_map else "cuda"
        if s.device_map:
            kwargs["offload_folder"] = offload_folder
    try:
        model = AutoModelForCausalLM.from_pretrained(s.model, **kwargs)
    except (OSError, ValueError) as err:
        raise ElsaError(f"--model {s.model}: cannot load the weights ({str(err).splitlines()[0]})") from None
    model.config.use_cache = False  # scoring forwards build no KV cache; generate() follows generation_config instead
    return model.eval()


def resolve_dtype(name: str | None) -> torch.dtype:
    return DTYPES[name] if name else torch.bfloat16 if torch.cuda.is_available() else torch.float32


def max_windows(source: str, limit: int | None) -> int | None:
    """C4 is capped at 256 windows by the protocol, everything else uses every window; --limit caps all."""
    caps = [c for c in (C4_WINDOWS if source == "c4" else None, limit) if c is not None]
    return min(caps) if caps else None


def ppl_windows(source: str, tokenizer, seqlen: int, limit: int | None) -> torch.Tensor:
    """The validation windows [n, seqlen] of one --ppl source; ElsaError when there are none."""
    try:
        windows = load_blocks(source, "validation", tokenizer, seqlen, max_windows(source, limit))
    except ElsaError as err:
        raise ElsaError(f"--ppl: {err}") from None
    except Exception as err:  # datasets/hub raise many types; offline machines are the usual cause
        if source not in NAMED_SOURCES:
            raise
        raise ElsaError(f"--ppl {source}: cannot load the dataset ({type(err).__name__}: {str(err).splitlines()[0]}); "
                        "it needs the Hugging Face hub or a local datasets cache") from None
    if windows.shape[0] == 0:
        raise ElsaError(f"--ppl {source}: no windows of {seqlen} tokens (the text is empty or shorter than one window); "
                        "use a longer text or a smaller --seqlen")
    return windows


def say(msg: str) -> None:
    print(f"[elsa_ds] {msg}", flush=True)


def run(s: EvalSettings) -> dict[str, Any]:
    """Evaluate ``s.model``; writes ``s.output``/``s.markdown`` atomically when given and returns the result."""
    started = time.time()
    check_settings(s)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items()}
    say("evaluation settings:\n" + json.dumps(settings, indent=2))
    manager = task_manager(s.tasks, s.include_path) if s.tasks else None
    config = load_config(s.model)
    max_positions = getattr(config, "max_position_embeddings", None)
    if s.ppl and max_positions and s.seqlen > max_positions:
        raise ElsaError(f"--seqlen {s.seqlen} exceeds the model's max_position_embeddings {max_positions}; "
                        f"pass --seqlen {max_positions} or less")
    tokenizer = load_tokenizer(s.model)
    windows = {source: ppl_windows(source, tokenizer, s.seqlen, s.limit) for source in s.ppl}
    for source, w in windows.items():
        say(f"perplexity data {source}: {w.shape[0]} windows x {s.seqlen} tokens")
        if source == "c4" and s.limit is None and w.shape[0] < C4_WINDOWS:
            say(f"warning: c4 gave {w.shape[0]} windows, fewer than the protocol's {C4_WINDOWS}; not comparable with published tables")

    if s.device_map and not torch.cuda.is_available():
        say("--device_map auto needs CUDA; loading on the CPU")
    offloading = s.device_map is not None and torch.cuda.is_available()
    offload_dir = tempfile.TemporaryDirectory(prefix="elsa_offload_", dir=s.offload_folder) if offloading else contextlib.nullcontext()
    with offload_dir as offload:
        model = load_model(s, config, offload)
        device = str(next(model.parameters()).device)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        n_params = sum(p.numel() for p in model.parameters())
        say(f"loaded {s.model} ({config.model_type}, {n_params / 1e6:.1f} M parameters, {dtype}, {device})")
        sparsity = model_sparsity(s.model)
        perplexity = {}
        for source, w in windows.items():
            nll, tokens = window_nll(model, w, s.batch_size, progress=True)
            perplexity[source] = {"ppl": ppl(nll, tokens), "windows": int(w.shape[0]), "tokens": tokens}
            say(f"{source} perplexity {perplexity[source]['ppl']:.3f} over {w.shape[0]} windows")
        zs: dict[str, Any] = {}
        if s.tasks:
            zs = zeroshot(model, tokenizer, s.tasks, manager, s.batch_size, s.limit)
            if zs["add_bos_token"] and not zs["bos_first"]:
                say("warning: add_bos_token=True, but this tokenizer does not prepend BOS when asked to; "
                    "lm-eval's inputs start without BOS")

    tasks, average_acc = zs.pop("tasks", {}), zs.pop("average_acc", None)
    result = {
        "model": s.model,
        "model_type": config.model_type,
        "dtype": dtype,
        "device": device,
        "seqlen": s.seqlen,
        "settings": settings,
        "protocol": {
            "ppl": PROTOCOL,
            "bos_per_window": tokenizer.bos_token_id is not None,
            "ppl_split": "validation (wikitext2: the test split, all windows; c4: the first 1100 validation documents, "
                         f"{C4_WINDOWS} windows; local files: all windows)",
            "zeroshot": "lm-eval-harness simple_evaluate, num_fewshot 0, acc and acc_norm, average = mean acc over tasks",
            "limit": s.limit,
        },
        "sparsity": sparsity,
        "ppl": perplexity,
        "tasks": tasks,
        "average_acc": average_acc,
        "zeroshot": zs or None,
        "wall_s": time.time() - started,
        "versions": versions(),
    }
    table = results_table([result])
    print(table, flush=True)
    if s.output is not None:
        write_atomic(Path(s.output), json.dumps(result, indent=2) + "\n")
        say(f"wrote {s.output}")
    if s.markdown is not None:
        write_atomic(Path(s.markdown), table)
        say(f"wrote {s.markdown}")
    return result


def model_sparsity(model_id: str) -> dict[str, Any]:
    """sparsity_report over the model's safetensors files (a local directory or the hub cache after loading)."""
    from transformers.utils import cached_file

    try:
        return sparsity_report(Path(cached_file(model_id, "config.json")).parent)
    except (ElsaError, OSError) as err:  # e.g. a .bin-only checkpoint: report why instead of failing the job
        say(f"warning: no sparsity report: {err}")
        return {"error": str(err)}


def versions() -> dict[str, str]:
    import lm_eval
    import transformers

    import elsa_ds

    return {"elsa_ds": elsa_ds.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "lm_eval": lm_eval.__version__}


def evaluate_output(output_dir: Path, ppl_sources: list[str], tasks: list[str], include_path: str | None,
                    seqlen: int) -> dict[str, Any] | None:
    """Evaluate a pruning job's saved model in the job's own process (rank 0, after its last collective) and
    add a summary to its ``elsa_report.json``; the full result goes to ``eval.json`` and ``eval.md`` beside it."""
    from elsa_ds.evaluation.zeroshot import expand_tasks
    from elsa_ds.output import REPORT_NAME, write_json

    if not ppl_sources and not tasks:
        return None
    say(f"evaluating {output_dir} (ppl: {ppl_sources or 'none'}; tasks: {tasks or 'none'})")
    result = run(EvalSettings(
        model=str(output_dir), ppl=list(ppl_sources), tasks=expand_tasks(",".join(tasks)) if tasks else [],
        include_path=include_path, seqlen=seqlen, device_map="auto" if torch.cuda.is_available() else None,
        output=output_dir / "eval.json", markdown=output_dir / "eval.md",
    ))
    report_path = output_dir / REPORT_NAME
    report = json.loads(report_path.read_text())
    report["evaluation"] = {"file": "eval.json", "ppl": {k: v["ppl"] for k, v in result["ppl"].items()},
                            "tasks": {k: v.get("acc") for k, v in result["tasks"].items()}, "average_acc": result["average_acc"]}
    write_json(report_path, report)
    return result
