"""elsa_ds from Python: ``elsa_ds.prune(...)`` and ``elsa_ds.oneshot(...)``, the same jobs as ``launch/prune.py``.

    import elsa_ds
    report = elsa_ds.prune("google/gemma-2-2b", "c4", output_dir="out/g2-70", sparsity=0.7, steps=4096)
    report = elsa_ds.oneshot(model, "sparsegpt", ["a document", "another one", ...], tokenizer=tok,
                             output_dir="out/g2-sgpt-70", sparsity=0.7, seqlen=256)
    report = elsa_ds.oneshot("google/gemma-2-2b", "wanda", "c4", finetune="full", finetune_steps=4096,
                             output_dir="out/g2-wanda-ft-90", sparsity=0.9)       # the retraining baseline

Run in one process it is a one-rank job; under ``deepspeed --num_gpus N script.py`` every rank calls it and rank 0
gets the report (the other ranks get None). Settings are the command line's flags: ElsaConfig's fields and the job's own
``export_format``, ``ignore_memory_check``, ``resume_if_any``, ``log_level``; any path among them (and the arguments)
may be a str or an os.PathLike such as pathlib.Path.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from elsa_ds.data.sources import IN_MEMORY_FOLDER, write_documents
from elsa_ds.errors import ElsaError, sigterm_unwinds
from elsa_ds.jobs.owner import run_owned
from elsa_ds.log import logging_for, warnings_filtered
from elsa_ds.methods import DENSE, oneshot_names
from elsa_ds.plan import read_settings
from elsa_ds.quoting import shown
from elsa_ds.settings.options import JobOptions, job_options
from elsa_ds.zero.dist import launcher_env_restored
from elsa_ds.zero.engine import built_engines, release_engines

Dataset = Any  # a name or path (str / os.PathLike), a list of strings, or a datasets.Dataset with a "text" column
# the job's own flags a keyword may set beside ElsaConfig's fields (the rest of JobOptions are these functions' arguments)
RUN_SETTINGS = ("resume_if_any", "ignore_memory_check", "export_format", "log_level")
_ONE_JOB = threading.Lock()  # held by the job this process runs (an audit: two threads' jobs corrupted each other)


def prune(model: Any, dataset: Dataset = None, *, output_dir: str | Path, deepspeed: str | Path = "zero3_offload",
          tokenizer: Any = None, overwrite: bool = False, resume: bool = False, recipe: str | None = None,
          **settings: Any) -> dict[str, Any] | None:
    """Prune ``model`` (hub id, directory, or a loaded transformers model) with ELSA under ZeRO-3.

    ``dataset``: a source name (``c4``, ``wikitext2``, a ``datasets`` name), a local path, a list of documents or
    a ``datasets.Dataset``; in-memory documents are read exactly like a .jsonl file holding them. A loaded model is
    consumed (ZeRO-3 partitions its parameters): load the result from ``output_dir``. Returns the report.
    A SIGTERM during the call (with Python's default handler in place) ends the process as it would anyway, once the
    job's staging, side files and lock are gone.
    """
    if settings.get("method", "elsa") != "elsa":  # a user's walk: prune(method="wanda") ran Wanda
        raise ElsaError(f"method={settings['method']!r}: elsa_ds.prune runs ELSA; a one-shot method (and its retraining) is "
                        f"elsa_ds.oneshot(model, {settings['method']!r}, ...)")
    return _run(model, dataset, output_dir, deepspeed, tokenizer, overwrite, resume, recipe, settings)


def oneshot(model: Any, method: str = "sparsegpt", dataset: Dataset = None, *, output_dir: str | Path,
            deepspeed: str | Path = "zero3_offload", tokenizer: Any = None, overwrite: bool = False, resume: bool = False,
            **settings: Any) -> dict[str, Any] | None:
    """Prune ``model`` with a one-shot method (magnitude, wanda, sparsegpt), layer by layer; a loaded model is pruned
    in place and left in the dtype the output is written in (the config's bf16, fp32 where it is off on a CPU). With
    ``finetune="full"`` or ``"lora"`` (and ``finetune_steps``) the mask is then retrained under ZeRO-3 like ELSA trains
    (``resume`` continues such a run); ``method="dense"`` with ``finetune`` is the unpruned control. Returns the report."""
    if method not in (*oneshot_names(), DENSE):  # None too: the settings read None as unset, which is ELSA
        raise ElsaError(f"method={method!r}: elsa_ds.oneshot runs a one-shot method ({', '.join(oneshot_names())}) or the "
                        f"{DENSE} control (with finetune); ELSA is elsa_ds.prune(model, dataset, ...)")
    return _run(model, dataset, output_dir, deepspeed, tokenizer, overwrite, resume, None, {**settings, "method": method})


def _run(model: Any, dataset: Dataset, output_dir, deepspeed, tokenizer, overwrite: bool, resume: bool, recipe: str | None,
         settings: dict[str, Any]) -> dict[str, Any] | None:
    """One job at a time per process, whose engine is given up at its end, and the caller's torch generators as they
    were (the job seeds them: an audit's sweep drew the same "random" settings after every call)."""
    import torch

    if not _ONE_JOB.acquire(blocking=False):  # the process group, DeepSpeed's and transformers' patches are global
        raise ElsaError("another elsa_ds job runs in this process (another thread): run jobs one after another, or in "
                        "separate processes")
    kept, stopped = built_engines(), False  # a caller's own engines are left alone
    # the CPU generator, and the current GPU's where the caller has used CUDA (not every visible GPU's: on each rank of a
    # launcher that would make a context on every GPU)
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            return _run_job(model, dataset, output_dir, deepspeed, tokenizer, overwrite, resume, recipe, settings)
    except BaseException as err:
        stopped = not isinstance(err, Exception)  # Ctrl-C, an exit: no device synchronization on the way out
        raise
    finally:
        try:
            release_engines(kept, destroy=not stopped)  # each call's engine stayed alive for the rest of the process
        finally:
            _ONE_JOB.release()


def _run_job(model: Any, dataset: Dataset, output_dir, deepspeed, tokenizer, overwrite: bool, resume: bool,
             recipe: str | None, settings: dict[str, Any]) -> dict[str, Any] | None:
    _check_arguments(model, output_dir, deepspeed, tokenizer, recipe)  # overwrite, resume: JobOptions checks them
    # every path a str from here on, a list setting's too (eval_ppl); a dataset's list is its documents, never paths
    model, dataset, output_dir, deepspeed, recipe = map(_fspath, (model, dataset, output_dir, deepspeed, recipe))
    settings = {k: type(v)(map(_fspath, v)) if type(v) in (list, tuple) else _fspath(v) for k, v in settings.items()}
    in_memory = not isinstance(model, (str, os.PathLike))
    run = {k: settings[k] for k in RUN_SETTINGS if k in settings}  # the job's flags beside ElsaConfig's (export_format...)
    with sigterm_unwinds(), _temporary_folder() as tmp:  # SIGTERM: both cleaned up
        name = _dataset_name(dataset, Path(tmp))
        opts = job_options({"deepspeed": deepspeed, "output_dir": Path(output_dir), "overwrite": overwrite, "resume": resume,
                            "recipe": recipe, "model_object": model if in_memory else None, "tokenizer_object": tokenizer,
                            **run}, given_as="the arguments")
        given = {**{k: v for k, v in settings.items() if k not in run}, "model": _model_name(model) if in_memory else str(model),
                 "dataset": name}
        with logging_for(opts.log_level) if "log_level" in run else warnings_filtered():  # for this call only
            cfg, ds_config = read_settings(opts, given, spelt="")
            with launcher_env_restored():
                return run_owned(cfg, opts, ds_config)


def _check_arguments(model: Any, output_dir: Any, deepspeed: Any, tokenizer: Any, recipe: Any) -> None:
    """Wrong argument types and a model without weights, named before anything is read (the settings are checked by
    ElsaConfig, the dataset by ``_dataset_name``)."""
    import torch
    from transformers import PreTrainedTokenizerBase

    def wrong(name: str, value: Any, expected: str) -> ElsaError:
        return ElsaError(f"{name}: expected {expected}, got {type(value).__name__} {shown(value, 60)}")

    if not isinstance(model, (str, os.PathLike)) and not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
        raise wrong("model", model, "a hub id, a model directory or a loaded transformers model (with its .config)")
    tensors = itertools.chain(model.named_parameters(), model.named_buffers()) if isinstance(model, torch.nn.Module) else ()
    if meta := next((name for name, t in tensors if t.is_meta), None):  # torch's "Cannot copy out of meta tensor" otherwise
        raise ElsaError(f"model: its weights are not loaded ({meta} is on the meta device): load them, e.g. with "
                        "from_pretrained, or pass the model's folder")
    for name, value in (("output_dir", output_dir), ("deepspeed", deepspeed)):
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise wrong(name, value, "a path (str or os.PathLike)")
    if recipe is not None and not isinstance(recipe, (str, os.PathLike)):
        raise wrong("recipe", recipe, "a recipe name or path")
    if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise wrong("tokenizer", tokenizer, "a transformers tokenizer")


def _fspath(value: Any) -> Any:
    """A path-like value as the str a setting's field takes: the fields are typed ``str`` for the command line, and
    refused ``sparsity_profile=Path(...)`` as "Input should be a valid string"."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _model_name(module: Any) -> str:
    """What the report calls a model given in memory: its hub id or directory when it knows one."""
    name = getattr(getattr(module, "config", None), "_name_or_path", "") or getattr(module, "name_or_path", "")
    if not name or (Path(name).is_absolute() and not (Path(name) / "config.json").is_file()):
        return f"in-memory {type(module).__name__}"
    return str(name)


@contextlib.contextmanager
def _temporary_folder() -> Iterator[str]:
    """The call's temporary folder (documents given in memory go there); a TMPDIR where none can be made is an ElsaError
    (a review: a full disk's mkdir was a raw OSError)."""
    try:
        folder = tempfile.TemporaryDirectory(prefix=IN_MEMORY_FOLDER)
    except OSError as err:
        raise ElsaError(f"no temporary folder can be made in {tempfile.gettempdir()} ({err.strerror or err}): set TMPDIR to "
                        "a folder with room") from None
    with folder as path:
        yield path


def _dataset_name(dataset: Dataset, tmp: Path) -> str | None:
    """A source name or path as is; in-memory documents written into ``tmp`` (``data.sources.write_documents``)."""
    if dataset is None or isinstance(dataset, str):  # a path is a str by now (_fspath)
        return None if dataset is None else str(dataset)
    texts = _texts(dataset)
    try:
        return str(write_documents(texts, tmp))
    except OSError as err:  # an audit: a full TMPDIR was a raw OSError from the API, not its ElsaError
        raise ElsaError(f"dataset: the documents given in memory could not be written to {tmp} ({err.strerror or err}), "
                        f"~{sum(map(len, texts)) / 2**20:,.1f} MiB of text: set TMPDIR to a folder with room, or pass "
                        "the documents as a file") from None


def _texts(dataset: Any) -> list[str]:
    if isinstance(dataset, Mapping):  # a dict (or a datasets.DatasetDict) would be read as its keys
        raise ElsaError(f"dataset: a {type(dataset).__name__} is not a list of documents; pass its texts as a list, or one "
                        "split of a DatasetDict (e.g. dataset['train'])")
    if hasattr(dataset, "column_names"):  # a datasets.Dataset
        if "text" not in dataset.column_names:
            raise ElsaError(f"the dataset has no 'text' column (columns: {dataset.column_names})")
        texts = [t for t in dataset["text"] if t is not None]  # None: no document (str() trained on "None")
        if wrong := [t for t in texts if not isinstance(t, str)]:  # 0 and b"" too
            raise ElsaError(f"the dataset's 'text' column holds {type(wrong[0]).__name__} values ({shown(wrong[0], 60)}), "
                            "not strings")
        return texts
    try:
        texts = list(dataset)
    except TypeError:
        texts = []  # not iterable: refused below
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ElsaError("dataset must be a name, a path, a non-empty list of strings or a datasets.Dataset with a 'text' column")
    return texts


__all__ = ["JobOptions", "oneshot", "prune"]
