"""Texts a job can only have from the Hugging Face hub, checked before it starts.

A ``datasets`` name (``c4``, ``wikitext2``, any other name) and an lm-eval task's data are downloaded when first read,
which for ``--eval_ppl`` and ``--eval_tasks`` is after the whole run. Where the hub cannot be asked (offline, no route)
and nothing of such a dataset is in the local caches, the job is refused at once, naming them, rather than failing
after its work or after the hub client's retries. A cache that holds something of it is trusted (the loader says
what else it lacks); behind a proxy the hub client is left to say (:func:`hub_unreachable`).
"""
from __future__ import annotations

import difflib
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from elsa_ds.data.sources import DEMO_DATASET, looks_local
from elsa_ds.errors import ElsaError

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be asked now (offline mode, or its host unknown or unreachable), or None; behind a
    proxy (which the hub client uses and a direct connection would not) the hub client is left to say."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    try:
        socket.create_connection((host, endpoint.port or (80 if endpoint.scheme == "http" else 443)), timeout=timeout).close()
    except OSError as err:
        return f"the hub ({host}) cannot be reached from here ({err.strerror or err})"
    return None


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


def text_repos(sources) -> dict[str, str]:
    """``(flag, source)`` pairs -> ``"--flag 'source'"`` -> the hub dataset it is read from, for those only the hub has;
    ElsaError for a path that is not there (a user's walk: a mistyped file was blamed on the hub)."""
    sources = list(sources)
    for flag, source in sources:
        if source and looks_local(source) and not Path(source).expanduser().exists():
            raise ElsaError(f"{flag} {source!r}: no such file or directory")
    return {f"{flag} {source!r}": repo for flag, source in sources if source and (repo := hub_repo(source))}


INCLUDE_FLAGS = {"--eval_tasks": "--eval_include_path", "--tasks": "--include_path"}  # where each command reads task YAMLs


def task_repos(manager, tasks: list[str], flag: str) -> dict[str, str]:
    """``"--flag task"`` -> the hub dataset its lm-eval YAML reads (``dataset_path``), for the tasks that name one (lm-eval
    0.4.13's index; a group, an included base YAML or another version's index: not checked, its loader will say)."""
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES  # json, csv, parquet, text...: local files' builders

    found = {}
    for task in tasks:
        entry = getattr(manager, "task_index", {}).get(task)
        path = (getattr(entry, "cfg", None) or {}).get("dataset_path")
        if isinstance(path, str) and path not in _PACKAGED_DATASETS_MODULES and not Path(path).expanduser().exists():
            found[f"{flag} {task}"] = path
    return found


def check_hub_texts(texts: dict[str, str], tasks: dict[str, str], named: tuple[str, ...] = ()) -> None:
    """ElsaError when the hub cannot be asked and the caches hold nothing of some of ``texts`` (:func:`text_repos`) or
    ``tasks``' data (:func:`task_repos`); ``named``: the sources a typo may have meant."""
    missing = {what: repo for what, repo in {**texts, **tasks}.items() if not cached(repo)}
    if not missing or (why := hub_unreachable()) is None:
        return
    said = []
    for what, repo in missing.items():
        near = [] if repo in NAMED_REPOS.values() else difflib.get_close_matches(repo, named, n=1)
        # a relative path mistyped reads as a hub id (owner/name): a walk's --dataset data/shakespeare_dir blamed the hub
        local = f"; no file or folder of that name in {Path.cwd()} either" if what in texts and "/" in repo and \
            repo not in NAMED_REPOS.values() else ""
        said.append(f"{what} ({repo}{local}{f'; did you mean {near[0]}?' if near else ''})")
    texts_missing = any(what in texts for what in missing)
    includes = sorted({INCLUDE_FLAGS.get(what.split()[0], "--include_path") for what in missing if what not in texts})
    way = ("give a local file or folder (.txt, .md, .jsonl, .parquet)" if texts_missing else
           f"use task YAMLs that read local files ({' / '.join(includes)} FOLDER: where they are)")  # an audit: unnamed
    raise ElsaError(f"{'; '.join(said)}: {'datasets' if len(said) > 1 else 'a dataset'} of the Hugging Face hub, which "
                    f"cannot be asked here ({why}), and not in the local datasets cache; run once where the hub is reachable "
                    f"(datasets keeps what it downloads), or {way}")
