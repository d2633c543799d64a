"""Zero-shot accuracy through lm-eval-harness 0.4.x on an already loaded model.

Settings follow the pruning papers: num_fewshot 0, acc (and acc_norm where the task defines it) per task,
the unweighted mean of acc over the requested tasks.
"""
from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elsa_ds.errors import ElsaError, described, require

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PAPER_TASKS: tuple[str, ...] = ("boolq", "rte", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
METRICS: tuple[str, ...] = ("acc", "acc_norm")


def expand_tasks(given: Sequence[str]) -> list[str]:
    """Task names -> unique names in order; ``paper`` stands for the seven tasks of the papers."""
    names: list[str] = []
    for name in (n.strip() for n in given):
        for task in PAPER_TASKS if name == "paper" else (name,) if name else ():
            if task not in names:
                names.append(task)
    if not names:
        raise ElsaError(f"--tasks {','.join(given)!r} names no task; give e.g. --tasks paper or --tasks boolq,rte")
    return names


def task_manager(tasks: list[str], include_path: str | None, flag: str = "--tasks", include_flag: str = "--include_path"):
    """An lm-eval TaskManager that knows every name in ``tasks``; raises ElsaError naming the unknown ones (the flags as
    the command calls them: a pruning job's are --eval_tasks and --eval_include_path).

    With --include_path, the local YAMLs are indexed alone first: indexing the ~15k built-in task YAMLs
    takes ~10 s and is only needed when a requested task is not local.
    """
    TaskManager = require("lm_eval.tasks", "eval", "zero-shot evaluation (--tasks, --eval_tasks)").TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ElsaError(f"{include_flag} {include_path}: no such directory")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        hints = {t: difflib.get_close_matches(t, manager.all_tasks, n=3) for t in unknown}
        said = "; ".join(f"{t!r}" + (f" (did you mean {', '.join(h)}?)" if h else "") for t, h in hints.items())
        where = f"lm-eval's built-in tasks or {include_path}" if include_path else "lm-eval's built-in tasks"
        hint = "" if include_path else f"; local task YAMLs need {include_flag} DIR"
        raise ElsaError(f"{flag}: unknown task {said}: not among {where}{hint}")
    return manager


def bos_setting(model: PreTrainedModel) -> bool | None:
    """add_bos_token for HFLM: True for Gemma (0.4.9+ no longer sets it), else the tokenizer's default."""
    return True if model.config.model_type.startswith("gemma") else None


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer.encode(text, add_special_tokens=True)``, which lm-eval calls, really puts BOS first."""
    ids = tokenizer.encode("a", add_special_tokens=True)
    return tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id


def zeroshot(model: PreTrainedModel, tokenizer, tasks: list[str], manager, batch_size: int, limit: int | None) -> dict[str, Any]:
    """Run ``tasks`` 0-shot on ``model``; per task acc/acc_norm with stderr and sample counts, and the mean acc."""
    lm_eval = require("lm_eval", "eval", "zero-shot evaluation (--tasks, --eval_tasks)")
    from lm_eval.models.huggingface import HFLM

    add_bos = bos_setting(model)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, add_bos_token=add_bos)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=0, limit=limit, task_manager=manager,
                                      log_samples=False)
    except OSError as err:  # the hub client's and datasets' failures to fetch a task's data (ConnectionError among them)
        raise ElsaError(f"tasks {', '.join(tasks)}: lm-eval could not load their data ({described(err)}); "
                        "run them where the Hugging Face hub is reachable once (datasets keeps what it downloads)") from None
    per_task = summarize(out, tasks)
    accs = [per_task[t]["acc"] for t in tasks if per_task.get(t, {}).get("acc") is not None]
    return {
        "tasks": per_task,
        "average_acc": sum(accs) / len(accs) if accs else None,
        "average_over": [t for t in tasks if per_task.get(t, {}).get("acc") is not None],
        "num_fewshot": 0,
        "limit": limit,
        "add_bos_token": add_bos,
        "bos_first": tokenizer_adds_bos(tokenizer),
        "batch_size": batch_size,
    }


def summarize(out: dict, tasks: list[str]) -> dict[str, dict[str, Any]]:
    """lm-eval's ``{"acc,none": x, "acc_stderr,none": s}`` -> ``{"acc": x, "acc_stderr": s}`` per task (groups' subtasks included)."""
    per_task: dict[str, dict[str, Any]] = {}
    for task, metrics in out["results"].items():
        row: dict[str, Any] = {}
        for metric in METRICS:
            for key in (metric, f"{metric}_stderr"):
                value = metrics.get(f"{key},none")
                if isinstance(value, (int, float)):
                    row[key] = float(value)
        samples = out.get("n-samples", {}).get(task)
        if samples:
            row["samples"] = samples.get("effective", samples.get("original"))
        per_task[task] = row
    missing = [t for t in tasks if t not in per_task]
    if missing:
        raise ElsaError(f"lm-eval returned no results for {missing}; its log above says why")
    return per_task
