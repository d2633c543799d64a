"""The evaluation job, start to end: model -> sparsity report -> perplexity -> zero-shot -> one JSON.

``launch/evaluate.py`` only parses arguments and calls ``run``. It evaluates a saved model in a process of its
own, or (``--eval_ppl`` / ``--eval_tasks`` of a pruning job) in rank 0 of the pruning job after every other rank
has left: never while other ranks wait on a collective (the ELSA authors' idle ranks hit the collective timeout
while rank 0 ran long zero-shot tasks). Every cheap check (task names, model config, output paths, text
windows) runs before the weights are loaded.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Iterable
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from elsa_ds.data import PplProtocol, PplWindows, evaluation_documents, load_tokenizer, ppl_windows, resolve_protocol
from elsa_ds.data.hub_texts import check_hub_texts, task_repos, text_repos
from elsa_ds.data.windows import C4_WINDOWS, LAYOUTS
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.perplexity import window_nll
from elsa_ds.evaluation.sparsity import NM_PATTERNS, model_sparsity_report, sparsity_report, with_patterns
from elsa_ds.evaluation.tables import results_table
from elsa_ds.evaluation.zeroshot import expand_tasks, task_manager, zeroshot
from elsa_ds.files.io import ATOMIC_ROOM, make_folder, versions, write_atomic
from elsa_ds.files.output import missing_folders
from elsa_ds.files.ownership import check_output_names
from elsa_ds.log import get_logger
from elsa_ds.loss import loss_choice
from elsa_ds.models import check_local_weights, check_seqlen, check_token_ids, is_sparse_checkpoint, load_causal_lm, load_config
from elsa_ds.settings.config import NAMED_TEXT_SOURCES, ElsaConfig
from elsa_ds.settings.config_checks import exact_kinds
from elsa_ds.settings.config_files import PathList, comma_list, job_pattern, job_targets, usable_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAMED_SOURCES = ("wikitext2", "c4")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
log = get_logger(__name__)


def _job_field(name: str) -> Any:
    """A copy of the job's field ``name`` (ElsaConfig's: default, bounds, help text), for a field that means the same:
    one meaning, one help text. Typed as pydantic types ``Field()``, which it stands for."""
    return copy(ElsaConfig.model_fields[name])


class EvalSettings(BaseModel):
    """One evaluation job: elsa-evaluate's flags are generated from these fields (``elsa_ds/cli.py``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: str = Field(..., json_schema_extra={"metavar": "ID_OR_DIR"})
    """Hub id or saved model directory (required unless --compare)."""
    ppl: PathList = Field(default_factory=list, json_schema_extra={"metavar": "LIST"})
    """Comma list of wikitext2, c4, shakespeare or local .txt/.md/.jsonl/.parquet paths or directories, each evaluated
    with the same protocol."""
    tasks: list[str] = Field(default_factory=list, json_schema_extra={"metavar": "LIST", "const": "paper"})
    """Comma list of lm-eval tasks, run 0-shot; 'paper' (or the flag without a value): boolq, rte, hellaswag, winogrande,
    arc_easy, arc_challenge, openbookqa."""
    include_path: str | None = Field(None, json_schema_extra={"metavar": "DIR"})
    """Directory of local lm-eval task YAMLs."""
    seqlen: int = Field(2048, ge=2)
    """Tokens per perplexity window."""
    ppl_protocol: PplProtocol = _job_field("ppl_protocol")
    batch_size: int = Field(1, ge=1)
    """Windows / lm-eval requests per forward."""
    limit: int | None = Field(None, ge=1)
    """Examples per lm-eval task and the most perplexity windows per dataset; quick checks only [all]."""
    dtype: Literal["bf16", "fp16", "fp32"] | None = None
    """Weights' dtype [bf16 on CUDA, fp32 on CPU]."""
    device_map: Literal["auto"] | None = None
    """Spread a model too large for one GPU over GPUs, CPU and disk (CUDA only) [one device]."""
    offload_folder: str | None = Field(None, json_schema_extra={"metavar": "DIR"})
    """Parent of the temporary disk-offload directory for --device_map auto [system temp]."""
    output: Path | None = Field(None, json_schema_extra={"metavar": "FILE.json"})
    """Write the result JSON here."""
    markdown: Path | None = Field(None, json_schema_extra={"metavar": "FILE.md"})
    """Write the markdown table here."""
    overwrite: bool = False
    """Replace an existing --output or --markdown file (without it the file is refused before anything loads)."""
    speed: bool = False
    """Instead of perplexity and zero-shot: bytes on disk, memory, prefill and decode tokens/s and logits agreement of the
    model's dense and sparse modes side by side, on the GPU when there is one, else the CPU (a local elsa-sparse
    checkpoint, or a dense pruned folder, compressed to a temporary one first)."""
    speed_prompt: int = Field(128, ge=1)
    """--speed: prompt tokens per sequence, prefilled before decoding."""
    speed_steps: int = Field(8, ge=1)
    """--speed: decode steps per timed round."""
    speed_rounds: int = Field(3, ge=1)
    """--speed: timed rounds per batch size, dense and sparse alternating."""

    _usable_paths = field_validator("model", "include_path", "offload_folder", "output", "markdown", mode="before")(usable_path)
    _exact_kinds = field_validator("*", mode="before")(exact_kinds)  # --limit True was one window

    @field_validator("tasks", mode="before")
    @classmethod
    def _expand_tasks(cls, v: Any) -> Any:
        """'paper' stands for the seven tasks; a name given twice counts once (ElsaError when none is named)."""
        return expand_tasks(comma_list(v)) if isinstance(v, str) or v else v


def check_settings(s: EvalSettings) -> None:
    """Reject unwritable outputs, and an ELSA_DS_LOSS that is not a choice, before anything is loaded (the model's fields
    hold the numbers' bounds)."""
    loss_choice()
    for flag, path in (("--output", s.output), ("--markdown", s.markdown)):
        if path is None:
            continue
        if Path(path).is_dir():
            example = Path(path) / ("result.json" if flag == "--output" else "result.md")
            raise ElsaError(f"{flag} {path} is a directory; give a file name, e.g. {example}")
        missing = missing_folders(Path(path).parent)  # made for the result (write_outputs), as --output_dir's are
        parent = missing[-1].parent if missing else Path(path).parent
        if not parent.is_dir():
            raise ElsaError(f"{flag} {path}: {parent} is not a directory; choose another file")
    check_new_files({"--output": s.output, "--markdown": s.markdown}, s.overwrite)
    inputs = {Path(p).resolve() for p in s.ppl if Path(p).is_file()}
    for flag, path in (("--output", s.output), ("--markdown", s.markdown)):
        if path is not None and Path(path).resolve() in inputs:
            raise ElsaError(f"{flag} {path} is one of the --ppl texts: give the result its own file")


def check_new_files(paths: dict[str, Path | None], overwrite: bool) -> None:
    """The files a command writes (by flag): none exists unless ``overwrite``, and no two are the same file."""
    given = {flag: Path(path) for flag, path in paths.items() if path is not None}
    for flag, path in given.items():
        check_output_names(path, flag, beside=ATOMIC_ROOM, inside=0)  # each written whole, beside its lock (.NAME.lock)
        if (path.exists() or path.is_symlink()) and not overwrite:
            raise ElsaError(f"{flag} {path} exists; pass --overwrite to replace it, or choose another file")
    seen: dict[Path, str] = {}
    for flag, path in given.items():
        if (same := seen.get(path.resolve())) is not None:
            raise ElsaError(f"{same} and {flag} name the same file {path}: give each its own")
        seen[path.resolve()] = flag


def load_model(s: EvalSettings, config, offload_folder: str | None, sparse: bool) -> PreTrainedModel:
    """from_pretrained in the chosen dtype, on the GPU (or spread with device_map="auto") when there is one; an
    elsa-sparse checkpoint (``sparse``) through its own loader, decompressed (bit for bit the dense export it was made
    from), then spread as the dense export would be (:func:`spread`)."""
    if sparse:
        from elsa_ds.sparse import from_pretrained

        spreading = s.device_map is not None and torch.cuda.is_available()
        model = from_pretrained(s.model, mode="dense", dtype=resolve_dtype(s.dtype),
                                device="cuda" if torch.cuda.is_available() and not spreading else "cpu")
        if spreading:
            model = spread(model, offload_folder)
    else:
        kwargs: dict[str, Any] = {}
        if torch.cuda.is_available():
            kwargs["device_map"] = "auto" if s.device_map else "cuda"
            if s.device_map:
                kwargs["offload_folder"] = offload_folder
        model = load_causal_lm(s.model, resolve_dtype(s.dtype), config=config, **kwargs).eval()
    model.config.use_cache = False  # scoring only (lm-eval's forwards too): no KV cache built; this copy is never saved
    return model


def spread(model: PreTrainedModel, offload_folder: str | None, max_memory: dict[int | str, int] | None = None) -> PreTrainedModel:
    """``device_map="auto"`` for a model already built on the CPU (a decompressed elsa-sparse checkpoint): accelerate's
    placement as transformers computes it (balanced over the GPUs, then the CPU, then ``offload_folder``), so that a
    sparse export is scored where its dense export would be, not loaded whole onto one GPU (a 27B model on 24-80 GiB
    cards). ``max_memory``: accelerate's, by device (None: what each has free)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    from elsa_ds.zero.compat import placement_hints

    no_split, skip_keys = placement_hints(model)
    budget = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split)
    placed = sorted({f"cuda:{d}" if isinstance(d, int) else str(d) for d in device_map.values()})  # GPUs by index
    log.info(f"spreading the decompressed model over {', '.join(placed)} (device_map auto)")
    return dispatch_model(model, device_map=device_map, offload_dir=offload_folder, skip_keys=skip_keys)


def resolve_dtype(name: str | None) -> torch.dtype:
    return DTYPES[name] if name else torch.bfloat16 if torch.cuda.is_available() else torch.float32


def source_windows(source: str, tokenizer, seqlen: int, protocol: PplProtocol, requested: PplProtocol, limit: int | None) -> PplWindows:
    """The windows of one --ppl source (C4: at most 256, the protocol's; --limit caps all); ElsaError when there are none."""
    try:
        windows = ppl_windows(evaluation_documents(source), source, tokenizer, seqlen, protocol, requested, limit)
    except ElsaError as err:
        raise ElsaError(f"--ppl: {err}") from None
    except Exception as err:  # datasets/hub raise many types; offline machines are the usual cause
        if source not in NAMED_SOURCES:
            raise
        raise ElsaError(f"--ppl {source}: cannot load the dataset ({type(err).__name__}: {str(err).splitlines()[0]}); "
                        "it needs the Hugging Face hub or a local datasets cache") from None
    if windows.count == 0:
        raise ElsaError(f"--ppl {source}: no windows of {seqlen} tokens (the text is empty or shorter than one window); "
                        "use a longer text or a smaller --seqlen")
    return windows


@dataclass
class _Prepared:
    """What the cheap checks produced, before any weight is loaded."""

    settings: dict[str, Any]
    config: Any
    tokenizer: Any
    manager: Any
    protocol: PplProtocol
    windows: dict[str, PplWindows]


def prepare(s: EvalSettings) -> _Prepared:
    """Every check that needs no weights: settings, task names, model config, the perplexity windows."""
    check_settings(s)
    settings = s.model_dump(mode="json")
    manager = task_manager(s.tasks, s.include_path) if s.tasks else None
    config = load_config(s.model)
    if s.ppl:
        check_seqlen(config, s.seqlen, s.model)
    check_local_weights(s.model, config)
    check_hub_texts(text_repos(("--ppl", source) for source in s.ppl), task_repos(manager, s.tasks, "--tasks") if manager else {},
                    NAMED_TEXT_SOURCES)
    tokenizer = load_tokenizer(s.model)
    protocol = resolve_protocol(s.ppl_protocol, config)
    windows = {source: source_windows(source, tokenizer, s.seqlen, protocol, s.ppl_protocol, s.limit) for source in s.ppl}
    log.info("evaluation settings:\n" + json.dumps(settings, indent=2))  # after the checks: a refusal is one line
    for source, w in windows.items():
        check_token_ids(w.ids, config, s.model, f"--ppl {source}")
        capped = "" if s.limit is None else f"; --limit {s.limit}: the first windows of it"
        log.info(f"perplexity data {source}: {w.count} windows x {s.seqlen} tokens, {protocol.value} protocol ({w.rule}{capped})")
        if source == "c4" and s.limit is None and w.count < C4_WINDOWS:
            log.warning(f"c4 gave {w.count} windows, fewer than the protocol's {C4_WINDOWS}; not comparable with published tables")
    return _Prepared(settings, config, tokenizer, manager, protocol, windows)


def measure(s: EvalSettings, prep: _Prepared) -> dict[str, Any]:
    """Load the model, then its sparsity, perplexity per source and zero-shot accuracy."""
    if s.device_map and not torch.cuda.is_available():
        log.warning("--device_map auto needs CUDA; loading on the CPU")
    offloading = s.device_map is not None and torch.cuda.is_available()
    offload_dir = tempfile.TemporaryDirectory(prefix="elsa_offload_", dir=s.offload_folder) if offloading else contextlib.nullcontext()
    with offload_dir as offload:
        sparse = is_sparse_checkpoint(s.model)
        model = load_model(s, prep.config, offload, sparse)
        first = next(model.parameters())
        found: dict[str, Any] = {"device": str(first.device), "dtype": str(first.dtype).removeprefix("torch.")}
        log.info(f"loaded {s.model} ({prep.config.model_type}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
            f"{found['dtype']}, {found['device']})")
        found["sparsity"] = counted_sparsity(s.model, model, sparse)
        found["ppl"] = {}
        for source, w in prep.windows.items():
            nll, tokens = window_nll(lambda ids: model(input_ids=ids).logits, w.ids, s.batch_size, device=first.device, progress=True)
            found["ppl"][source] = {"ppl": w.perplexity(nll, tokens), "ppl_per_token": w.per_token(nll, tokens),
                                    "windows": w.count, "tokens": tokens, "nll_sum": nll, "denominator": w.denominator(tokens),
                                    "text": {"part": w.rule, "documents": w.documents, "text_tokens": w.text_tokens}}
            log.info(f"{source} perplexity {found['ppl'][source]['ppl']:.3f} over {w.count} windows")
        found["zeroshot"] = {}
        if s.tasks:
            found["zeroshot"] = zeroshot(model, prep.tokenizer, s.tasks, prep.manager, s.batch_size, s.limit)
            if found["zeroshot"]["add_bos_token"] and not found["zeroshot"]["bos_first"]:
                log.warning("add_bos_token=True, but this tokenizer does not prepend BOS when asked to; "
                    "lm-eval's inputs start without BOS")
    return found


def run(s: EvalSettings) -> dict[str, Any]:
    """Evaluate ``s.model``; writes ``s.output``/``s.markdown`` atomically when given and returns the result."""
    started = time.time()
    if s.speed:
        return run_speed(s, started)
    prep = prepare(s)
    found = measure(s, prep)
    zs = found.pop("zeroshot")
    tasks, average_acc = zs.pop("tasks", {}), zs.pop("average_acc", None)
    result = {
        "model": s.model, "model_type": prep.config.model_type, "dtype": found["dtype"], "device": found["device"],
        "seqlen": s.seqlen, "settings": prep.settings,
        "protocol": {
            "ppl": prep.protocol.value,
            "ppl_requested": s.ppl_protocol.value,
            "ppl_layout": LAYOUTS[prep.protocol],
            "ppl_text": "wikitext2: the test split's lines joined by blank lines; c4: the first 1100 validation documents joined "
                        f"by a space, at most {C4_WINDOWS} windows; local files: their documents joined by blank lines "
                        "(a directory named for splits: its validation, else test, files); the text tokenized once",
            "zeroshot": "lm-eval-harness simple_evaluate, num_fewshot 0, acc and acc_norm, average = mean acc over tasks",
            "limit": s.limit,
        },
        "sparsity": found["sparsity"], "ppl": found["ppl"], "tasks": tasks, "average_acc": average_acc, "zeroshot": zs or None,
        "wall_s": time.time() - started, "versions": versions(),
    }
    table = results_table([result])
    print(table, flush=True)  # the table is the command's product: stdout, whatever the log level
    write_outputs(s, result, table)
    return result


SCORING_ONLY = frozenset({"seqlen", "ppl_protocol", "batch_size", "limit", "dtype", "device_map", "offload_folder", "include_path"})


# which evaluation reads each flag, beside its default (--speed's own check names the scoring flags it does not read)
READ_BY = {"speed_prompt": "--speed", "speed_steps": "--speed", "speed_rounds": "--speed", "seqlen": "--ppl",
           "ppl_protocol": "--ppl", "batch_size": "--ppl and --tasks", "limit": "--ppl and --tasks", "include_path": "--tasks",
           "offload_folder": "--device_map auto"}


def _changed(s: EvalSettings, keys: Iterable[str]) -> set[str]:
    """The settings among ``keys`` that ``s`` holds at other than their default (given, for the command line)."""
    fields = EvalSettings.model_fields
    return {k for k in keys if getattr(s, k) != fields[k].get_default(call_default_factory=True)}


def check_flags_read(s: EvalSettings) -> None:
    """ElsaError naming a flag given for an evaluation this command does not run (an audit, 2026-12-07: --speed_rounds
    without --speed, --include_path without --tasks, --seqlen without --ppl were taken without a word)."""
    if s.speed:
        return
    runs = {"--speed": False, "--ppl": bool(s.ppl), "--tasks": bool(s.tasks), "--ppl and --tasks": bool(s.ppl or s.tasks),
            "--device_map auto": s.device_map is not None}
    changed = _changed(s, READ_BY)
    unread = [f"--{k} (read by {by})" for k, by in READ_BY.items() if not runs[by] and k in changed]
    if unread:
        raise ElsaError(f"given for an evaluation this command does not run: {', '.join(unread)}; add what reads "
                        f"{'it' if len(unread) == 1 else 'them'}, or drop {'it' if len(unread) == 1 else 'them'}")


def run_speed(s: EvalSettings, started: float) -> dict[str, Any]:
    """--speed: dense mode against sparse mode (elsa_ds.sparse.speed.speed_report) at batch 1 and 8, table and JSON; on
    the GPU when there is one, as the other evaluations."""
    from elsa_ds.sparse.speed import speed_report, speed_table

    check_settings(s)
    if s.ppl or s.tasks:
        raise ElsaError("--speed measures size and speed only; run --ppl/--tasks in a separate command")
    if unused := sorted(_changed(s, SCORING_ONLY)):  # a user's walk: --dtype fp32 was timed in the stored bf16
        raise ElsaError(f"--speed times the checkpoint in its stored dtype with --speed_prompt/--speed_steps/--speed_rounds; "
                        f"{', '.join('--' + k for k in unused)} {'is' if len(unused) == 1 else 'are'} for --ppl/--tasks: drop "
                        f"{'it' if len(unused) == 1 else 'them'}")
    if not Path(s.model).is_dir():
        raise ElsaError(f"--speed needs a local model folder (an elsa-sparse checkpoint or a dense pruned export); {s.model} is not one")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = speed_report(s.model, (1, 8), s.speed_prompt, s.speed_steps, s.speed_rounds, device=device)
    result.update(settings=s.model_dump(mode="json"), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                  load_average=os.getloadavg(), wall_s=time.time() - started, versions=versions())
    table = speed_table(result)
    print(table, end="", flush=True)  # the table is the command's product: stdout
    write_outputs(s, result, table)
    return result


def counted_sparsity(model_id: str, model: PreTrainedModel, sparse: bool) -> dict[str, Any]:
    """Zeros per pruned weight, over the weights the folder's job pruned (``job_targets``) where they are found here,
    else every decoder-layer weight; a count that cannot be made is recorded, not raised (the model is loaded by now)."""
    folder = Path(model_id).expanduser()
    nm = with_patterns(job_pattern(folder))  # the job's own N:M named as its report names it (a thirteenth audit)
    def count(pattern: str | None) -> dict[str, Any]:
        try:
            return model_sparsity_report(model, pattern, nm) if sparse else model_sparsity(model_id, pattern, nm)
        except ElsaError as err:  # a pattern too slow to match (NamePattern's limit)
            log.warning(f"no sparsity report: {err}")
            return {"error": str(err)}
    found = count(targets := job_targets(folder))
    if targets is not None and "error" not in found and not found["pruned_numel"]:
        log.warning(f"targets {targets} of its job's report name no weight here: sparsity over every decoder-layer weight")
        found = count(None)
    return found


def model_sparsity(model_id: str, targets: str | None = None, nm: tuple[tuple[int, int], ...] = NM_PATTERNS) -> dict[str, Any]:
    """sparsity_report over the model's safetensors files (a local directory or the hub cache after loading)."""
    from transformers.utils import cached_file

    try:
        config_file = cached_file(model_id, "config.json")
        if config_file is None:  # only with cached_file's raising turned off; it raises OSError otherwise
            raise OSError(f"{model_id}: no config.json")
        return sparsity_report(Path(config_file).parent, targets, nm)
    except (ElsaError, OSError) as err:  # e.g. a .bin-only checkpoint: report why instead of failing the job
        log.warning(f"no sparsity report: {err}")
        return {"error": str(err)}


def write_outputs(s: EvalSettings, result: dict[str, Any], table: str) -> None:
    """The result JSON (--output) and its table (--markdown), each written whole, their missing folders made first
    (elsa-evaluate made them before taking their locks; the job's own evaluation and the benches call ``run``)."""
    for path, text in ((s.output, json.dumps(result, indent=2) + "\n"), (s.markdown, table)):
        if path is not None:
            make_folder(Path(path).parent)
            write_atomic(Path(path), text)
            log.info(f"wrote {path}")
