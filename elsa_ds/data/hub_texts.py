"""Texts a job can only have from the Hugging Face hub, checked before it starts.

A ``datasets`` name (``c4``, ``wikitext2``, any other name) and an lm-eval task's data are downloaded when first read,
which for ``--eval_ppl`` and ``--eval_tasks`` is after the whole run. Where the hub cannot be asked (offline, no route)
and nothing of such a dataset is in the local caches, the job is refused at once, naming them, rather than failing
after its work or after the hub client's retries. A cache that holds something of it is trusted (the loader says
what else it lacks); behind a proxy the hub client is left to say (``capacity.shapes.hub_unreachable``).
"""
from __future__ import annotations

import difflib
from pathlib import Path

from elsa_ds.data.sources import DEMO_DATASET
from elsa_ds.errors import ElsaError

# the repositories behind the named sources (``sources.documents``)
NAMED_REPOS = {"wikitext2": "wikitext", "c4": "allenai/c4"}


def hub_repo(source: str) -> str | None:
    """The hub dataset ``source`` is read from, or None (the demo's texts, a local file or folder)."""
    if source == DEMO_DATASET or Path(source).expanduser().exists():
        return None
    return NAMED_REPOS.get(source, source)


def cached(repo: str) -> bool:
    """Whether the hub's or datasets' cache holds anything of dataset ``repo`` (any namespace: ``wikitext`` is now
    ``Salesforce/wikitext``)."""
    import datasets.config
    from huggingface_hub import constants

    base = repo.split("/")[-1]
    hub, local = Path(constants.HF_HUB_CACHE), Path(datasets.config.HF_DATASETS_CACHE)
    return any(hub.glob(f"datasets--{base}")) or any(hub.glob(f"datasets--*--{base}")) or \
        (local / base).exists() or any(local.glob(f"*___{base}"))


def task_repos(manager, tasks: list[str]) -> dict[str, str]:
    """lm-eval task -> the hub dataset its YAML reads (``dataset_path``), for the tasks that name one (lm-eval 0.4.13's
    index; a group, an included base YAML or another version's index: not checked, its loader will say)."""
    found = {}
    for task in tasks:
        entry = getattr(manager, "task_index", {}).get(task)
        path = (getattr(entry, "cfg", None) or {}).get("dataset_path")
        if isinstance(path, str) and not Path(path).expanduser().exists():
            found[task] = path
    return found


def check_hub_texts(needed: dict[str, str], named: tuple[str, ...] = ()) -> None:
    """ElsaError when the hub cannot be asked and the caches hold nothing of some of ``needed`` (what -> hub dataset);
    ``named``: the sources a typo may have meant."""
    from elsa_ds.capacity.shapes import hub_unreachable

    missing = {what: repo for what, repo in needed.items() if not cached(repo)}
    if not missing or (why := hub_unreachable()) is None:
        return
    said = []
    for what, repo in missing.items():
        near = [] if repo in NAMED_REPOS.values() else difflib.get_close_matches(repo, named, n=1)
        said.append(f"{what} ({repo}{f'; did you mean {near[0]}?' if near else ''})")
    texts = any(not what.startswith(("--eval_tasks", "--tasks")) for what in missing)
    way = "give a local file or folder (.txt, .md, .jsonl, .parquet)" if texts else "use task YAMLs that read local files"
    raise ElsaError(f"{'; '.join(said)}: {'datasets' if len(said) > 1 else 'a dataset'} of the Hugging Face hub, which "
                    f"cannot be asked here ({why}), and not in the local datasets cache; run once where the hub is reachable "
                    f"(datasets keeps what it downloads), or {way}")


def job_hub_texts(cfg, manager=None) -> dict[str, str]:
    """What a pruning job reads from the hub: its --dataset, --val_dataset, --eval_ppl texts and --eval_tasks' data."""
    sources = [("--dataset", cfg.dataset), ("--val_dataset", cfg.val_dataset), *(("--eval_ppl", s) for s in cfg.eval_ppl)]
    needed = {f"{flag} {source!r}": repo for flag, source in sources if source and (repo := hub_repo(source))}
    if manager is not None:
        from elsa_ds.evaluation.zeroshot import expand_tasks

        needed |= {f"--eval_tasks {task}": repo for task, repo in task_repos(manager, expand_tasks(cfg.eval_tasks)).items()}
    return needed
