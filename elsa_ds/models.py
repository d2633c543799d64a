"""Loading causal LMs: one attention rule, cheap checks before any weight is read, meta-device instances.

Every path that builds a model goes through here: the ZeRO-3 job (``zero/engine.py``, into partitions), the
one-shot methods (whole model in host memory), evaluation (one device or ``device_map="auto"``) and the
memory estimator (meta device: shapes without memory).
"""
from __future__ import annotations

import pickle

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from elsa_ds.data import load_tokenizer
from elsa_ds.data.blocks import check_local_tokenizer
from elsa_ds.data.sources import FILE_NOT_MODEL
from elsa_ds.errors import ElsaError
from elsa_ds.files.weight_files import (SPARSE_CONFIG_KEY, check_model_folder, check_weight_files, download_command, indexed_shards,
                                      sparse_shards, stored_shapes)
from elsa_ds.settings.config_files import name_problem, read_json_object

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config.json it cannot read or build a config from: OSError and ValueError of its
    own, huggingface_hub's strict-dataclass validation (a field of the wrong type), and the TypeError, KeyError,
    AttributeError, IndexError or ZeroDivisionError of a value of the wrong shape or size read deep inside a config
    class (0 attention heads), and json's RecursionError for a JSON file nested deeper than Python's stack."""
    from huggingface_hub.errors import StrictDataclassError

    return (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError, ArithmeticError, StrictDataclassError,
            RecursionError)


def reason(err: BaseException) -> str:
    """An exception as one short line: transformers' messages span lines; a bare KeyError is only the key."""
    text = " ".join(str(err).split()) or type(err).__name__
    text = text if isinstance(err, (OSError, ValueError)) else f"{type(err).__name__}: {text}"
    return text if len(text) <= 300 else text[:297] + "..."


def config_json(model_id: str) -> dict | None:
    """A local model's config.json (``model_id``: its directory or the file) read as JSON: ElsaError naming the file when
    it is not JSON, not an object, or names code of its own (``auto_map``) for an architecture transformers does not
    ship, which transformers would ask to run (``trust_remote_code``) and elsa_ds never does. None for a hub id."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(model_id).expanduser()
    if path.is_file() and path.suffix != ".json":  # a walk: model.safetensors was read as a config, "can't decode byte"
        raise ElsaError(f"model {model_id} {FILE_NOT_MODEL}")
    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        return None
    # read as transformers reads it (a key named twice: the last counts), so the checks see the values the model gets
    data = read_json_object(file, "model config", "fix it or copy the model's config.json again", unique=False)
    model_type = data.get("model_type")
    if data.get("auto_map") and not (isinstance(model_type, str) and model_type in CONFIG_MAPPING):
        raise ElsaError(f"{file}: model_type {model_type!r} needs its own Python code (auto_map, trust_remote_code), "
                        "which elsa_ds never runs; use a model whose architecture transformers ships")
    return data


SHIPPED_CONFIGS = Path(__file__).resolve().parent / "model_configs"  # hub models' configs the estimate reads offline


def shipped_config(model_id: str) -> Path | None:
    """The config.json elsa_ds ships for the hub id ``model_id``, or None; only an ``owner/name`` is looked up (an audit:
    a recipe's ``google/../../x`` read any config.json on the disk)."""
    parts = model_id.split("/")
    if len(parts) != 2 or any(part in ("", ".", "..") for part in parts) or name_problem(model_id):
        return None
    file = SHIPPED_CONFIGS / model_id / "config.json"
    return file if file.is_file() and file.resolve().is_relative_to(SHIPPED_CONFIGS) else None


def is_sparse_checkpoint(model_id: str) -> bool:
    """A local elsa-sparse checkpoint (``elsa-compress``'s folder), whose pruned weights are stored as ``NAME.values`` and
    positions: transformers finds no weight files in one of format version 3, and in one of versions 1 and 2 builds
    them at random, saying so only in a warning. Known by its config.json's block and its shards' own mark (a dense
    model saved from one may carry the block)."""
    data = config_json(model_id)
    return data is not None and SPARSE_CONFIG_KEY in data and sparse_shards(Path(model_id).expanduser())


def refuse_sparse_checkpoint(model_id: str, flag: str) -> None:
    """ElsaError for an elsa-sparse checkpoint where a job needs a model transformers loads (pruning, a mask's source): a
    folder, or a hub id's snapshot in this machine's Hugging Face cache."""
    folder = Path(model_id).expanduser() if Path(model_id).expanduser().is_dir() else cached_snapshot(model_id)
    if folder is not None and is_sparse_checkpoint(str(folder)):
        raise ElsaError(f"{flag} {model_id} is an elsa-sparse checkpoint (elsa-compress's values and positions), which "
                        "transformers cannot load as the model; give a dense folder "
                        "(elsa_ds.sparse.from_pretrained(path, mode='dense') then save_pretrained makes one; copy the "
                        "tokenizer files beside it; launch/evaluate.py reads the sparse one as it is)")


def load_config(model_id: str):
    """The model's transformers config, or an ElsaError that says whether a directory or a hub id failed."""
    from transformers import AutoConfig

    path = Path(model_id).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ElsaError(f"model {model_id}: directory has no config.json (not a saved transformers model)")

    def read():
        check_hub_reachable(model_id)  # after guarded_config's checks of a local path
        return AutoConfig.from_pretrained(model_id, trust_remote_code=False)

    config = guarded_config(model_id, read)
    check_causal_lm(config, model_id)
    return config


def check_hub_reachable(model_id: str) -> None:
    """ElsaError for a hub id this machine has not cached when the hub cannot be asked (offline mode, no route): the hub
    client would retry for ~30 s and then say so in a dozen lines (a walk: ``--recipe gemma-2-27b-s90`` offline)."""
    from elsa_ds.data.hub_texts import hub_unreachable

    if Path(model_id).expanduser().exists() or _in_hub_cache(model_id) or not (why := hub_unreachable()):
        return
    raise ElsaError(f"model {model_id}: cannot load it: not a folder here nor in the Hugging Face cache, and {why}: download it where "
                    f"the hub can be reached ({download_command(model_id)}) and pass its folder, or point HF_HOME "
                    "at a cache that holds it")


def _in_hub_cache(model_id: str) -> bool:
    return cached_snapshot(model_id) is not None


def check_local_path(model_id: str) -> None:
    """ElsaError for a model named as a path that is not there: one starting with ., / or ~, or whose first part is a
    folder here (``out/run1`` from a typo), which transformers would otherwise take for a hub id and retry for ~30 s;
    unless it is a hub id this machine knows (a shipped config, or in the Hugging Face cache)."""
    path = Path(model_id).expanduser()
    if path.exists():
        return
    if model_id.startswith((".", "/", "~")):
        raise ElsaError(f"model {model_id}: no such directory")
    parts = model_id.split("/")
    if len(parts) < 2 or not Path(parts[0]).is_dir() or len(parts) == 2 and _known_hub_id(model_id):
        return
    raise ElsaError(f"model {model_id}: no such directory ({parts[0]}/ is a folder here, so the name is read as a local path; "
                    "if you meant a hub model of that name, run from another folder)")


def _known_hub_id(model_id: str) -> bool:
    return shipped_config(model_id) is not None or _in_hub_cache(model_id)


def guarded_config(model_id: str, read: Callable[[], Any]):
    """``read()``, a config loader for ``model_id`` (``load_config``'s, the estimator's), after :func:`config_json`'s checks
    of a local config.json and :func:`check_model_folder`'s of its folder (read for its config and tokenizer even when
    its weights are not: ``--random_init``, the estimate); what transformers raises for a malformed one becomes an
    ElsaError naming the file."""
    check_local_path(model_id)
    check_model_folder(model_id, f"model {model_id}")
    config_json(model_id)
    path = Path(model_id).expanduser()
    where = path if path.is_file() else path / "config.json" if path.is_dir() else f"model {model_id}"
    try:
        return read()
    except config_errors() as err:
        raise ElsaError(f"{where}: cannot load it as a transformers config ({reason(err)})") from None


def max_positions(config) -> int | None:
    """The longest sequence the model was built for (``max_position_embeddings``, of the text model for a multimodal
    one); None when its config does not say."""
    value = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def check_seqlen(config, seqlen: int, model_id: str) -> None:
    """ElsaError for a --seqlen beyond the model's positions: learned position embeddings index past their table, rotary
    ones run outside what the model was trained on."""
    limit = max_positions(config)
    if limit is not None and seqlen > limit:
        raise ElsaError(f"--seqlen {seqlen} exceeds the max_position_embeddings {limit} of model {model_id}; "
                        f"pass --seqlen {limit} or less")


# heads that predict the next token: what ELSA's loss, the one-shot calibration and perplexity all need
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def check_causal_lm(config, model_id: str) -> None:
    """ElsaError for a model that is not a causal LM (an encoder such as BERT saved as a masked LM, a classifier, a
    sequence-to-sequence model): transformers would load some of them into a causal-LM class with a warning and the job
    would train or score next-token prediction the model was never built for."""
    archs = getattr(config, "architectures", None) or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ElsaError(f"model {model_id}: architectures in its config.json is {archs!r}, not a list of class names "
                        "(e.g. [\"LlamaForCausalLM\"])")
    kind = f"{getattr(config, 'model_type', '?')} ({', '.join(archs) or 'no architectures listed'})"
    if getattr(config, "is_encoder_decoder", False):
        raise ElsaError(f"model {model_id} is an encoder-decoder model, {kind}: elsa_ds prunes decoder-only causal LMs")
    if archs and not any(a.endswith(CAUSAL_HEADS) for a in archs):
        raise ElsaError(f"model {model_id} is {kind}, not a causal language model (a ...ForCausalLM): ELSA prunes on the "
                        "next-token loss, which this model was not trained for")


def check_token_ids(ids: torch.Tensor, config, model_id: str, what: str) -> None:
    """ElsaError when ``ids`` (``what`` tokenized) hold a token id the model has no embedding row for: a tokenizer of
    another model (or a damaged tokenizer.json) would otherwise fail inside the first forward pass."""
    vocab = getattr(getattr(config, "text_config", None) or config, "vocab_size", None)
    largest = int(ids.max()) if ids.numel() else -1
    if isinstance(vocab, int) and largest >= vocab:
        raise ElsaError(f"{what}: the tokenizer of model {model_id} gives token id {largest}, beyond the vocab_size {vocab} of "
                        "its config.json; the tokenizer files and the model do not belong together")


def attention_implementation(config) -> str:
    """eager for Gemma-2 (sdpa drops its attention-logit soft-capping, and flash-attn's softcap has no backward);
    sdpa otherwise."""
    return "eager" if getattr(config, "model_type", "") == "gemma2" else "sdpa"


def hidden_size(config) -> int | None:
    return getattr(getattr(config, "text_config", config), "hidden_size", None)


def check_local_weights(model_id: str, config=None) -> None:
    """Each weight file of a local model directory is whole and no pickle past the cap (``weight_files.py``) and, given its
    ``config``, holds each tensor it shares with the architecture in the shape the architecture gives it (from the
    headers: a config.json of another size fails inside from_pretrained otherwise, after the load). A hub id is checked
    in this machine's Hugging Face cache, whose snapshot transformers reads (one not downloaded yet is fetched and read by
    transformers, unchecked)."""
    local = Path(model_id).expanduser()
    if (folder := local if local.exists() else cached_snapshot(model_id)) is None:
        return
    if folder is not local:
        check_cached_shards(model_id, folder)
    check_weight_files(folder, f"model {model_id}", hub_id=None if folder is local else model_id)
    if config is None or not folder.is_dir() or getattr(config, "quantization_config", None):
        return  # a quantized checkpoint stores its weights packed, in other shapes than the architecture's
    stored = stored_shapes(folder)
    built = {name: tuple(p.shape) for name, p in meta_model(config).named_parameters(remove_duplicate=False)}
    wrong = [f"{file}: {name} {list(shape)} where config.json builds {list(built[name])}"
             for name, (shape, file) in stored.items() if name in built and built[name] != shape]
    if wrong:
        many = f"{len(wrong)} tensors differ, e.g." if len(wrong) > 1 else "1 tensor differs:"
        raise ElsaError(f"model {model_id}: config.json does not describe its weights ({many} {wrong[0]}); the config and the "
                        "weights come from different models")


def check_cached_shards(model_id: str, snapshot: Path) -> None:
    """ElsaError when the cache's snapshot lacks shards its index names (a download cut short) and the hub cannot be asked
    for them: transformers would fail at the load, after the plan's checks and the warm start."""
    from elsa_ds.data.hub_texts import hub_unreachable

    missing = [shard for file, (_, _, shard) in indexed_shards(snapshot).items() if not file.exists()]
    if missing and (why := hub_unreachable()):
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ElsaError(f"model {model_id}: the Hugging Face cache ({snapshot}) lacks {missing[0]}{more}, which its index names, "
                        f"and {why}: finish the download where the hub can be reached ({download_command(model_id)})")


def cached_snapshot(model_id: str) -> Path | None:
    """The Hugging Face cache's snapshot folder of hub id ``model_id`` (its main revision, as transformers resolves it),
    or None where this machine holds none."""
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(model_id, "config.json")
    except ValueError:  # not a valid repository id
        return None
    return Path(config).parent if isinstance(config, str) else None


def load_causal_lm(model_id: str, dtype: torch.dtype, *, random_init: bool = False, config=None, **kwargs: Any) -> PreTrainedModel:
    """``from_pretrained`` (or ``from_config`` with ``random_init``) with the attention rule; ElsaError on failure.

    Under a live ``HfDeepSpeedConfig`` with ZeRO-3 both build straight into partitions.
    """
    from transformers import AutoModelForCausalLM

    config = config or load_config(model_id)
    if not random_init:
        refuse_sparse_checkpoint(model_id, "model")
    attn = attention_implementation(config)
    try:
        if random_init:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn, trust_remote_code=False)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_id, dtype=dtype, attn_implementation=attn, trust_remote_code=False,
                                                         **kwargs)
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: a side file (generation_config.json) nested too deep
        raise ElsaError(f"cannot load model {model_id!r}: {str(err).splitlines()[0]}") from None
    except pickle.UnpicklingError as err:  # torch's weights-only loader refused a .bin file: nothing of it ran
        raise ElsaError(f"cannot load model {model_id!r}: a .bin weights file holds objects beyond tensors or is damaged "
                        f"({str(err).splitlines()[0][:120]}), and loading it could run code; use the model's safetensors "
                        "files or a copy you trust") from None
    return model  # its config's use_cache as given (exports keep it): our forwards pass use_cache=False themselves


def as_transformers(model: torch.nn.Module) -> PreTrainedModel:
    """``model`` typed as the transformers model it is: every model elsa_ds loads or is given is one, though the engine
    and the jobs carry it as an nn.Module (whose attributes torch types as tensors or modules)."""
    return cast("PreTrainedModel", model)


def embedding_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The input embedding's and the output head's weights (one tensor when tied)."""
    hf = as_transformers(model)
    modules = (hf.get_input_embeddings(), hf.get_output_embeddings())
    weights = [m.get_parameter("weight") for m in modules if m is not None]  # m.weight, typed as the Parameter it is
    return list({id(w): w for w in weights}.values())


def freeze_embeddings(model: torch.nn.Module) -> None:
    """Take the input embedding and the output head out of training (--freeze_embeddings)."""
    for weight in embedding_weights(model):
        weight.requires_grad_(False)


def meta_model(config) -> PreTrainedModel:
    """An instance of the architecture on the meta device: exact shapes and names, no memory."""
    from transformers import AutoModelForCausalLM

    errors: tuple[type[BaseException], ...] = (*config_errors(), RuntimeError)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except errors as err:  # e.g. a negative size: torch's RuntimeError
        name = getattr(config, "name_or_path", "") or getattr(config, "model_type", "?")
        raise ElsaError(f"model {name}: its config.json describes no model transformers can build ({reason(err)})") from None


@dataclass
class ModelSource:
    """A model named by hub id or directory, or one already in memory (``module``, with its ``tokenizer``).

    An in-memory model is used as it is, not copied: a ZeRO-3 job partitions its parameters (the object is
    consumed; load the result from the output directory), a one-shot job prunes it in place.
    """

    name: str
    module: PreTrainedModel | None = None
    tokenizer: Any = None

    def config(self):
        return self.module.config if self.module is not None else load_config(self.name)

    def check_weights(self) -> None:
        if self.module is None:
            refuse_sparse_checkpoint(self.name, "--model")
            check_local_weights(self.name, self.config())

    def check_tokenizer(self) -> None:
        if self.tokenizer is None:
            check_local_tokenizer(self.name)

    def load_tokenizer(self):
        return self.tokenizer if self.tokenizer is not None else load_tokenizer(self.name)

    def load(self, dtype: torch.dtype, random_init: bool = False) -> PreTrainedModel:
        """The model in ``dtype``: the in-memory one, or loaded (``random_init``: built from the config)."""
        if self.module is None:
            return load_causal_lm(self.name, dtype, random_init=random_init)
        if random_init:
            raise ElsaError("random_init builds a model from its config; it cannot be combined with a model given in memory")
        # the parameters alone, as DeepSpeed casts a module it is given and as from_pretrained(dtype=...) leaves one: a
        # buffer keeps its dtype (Gemma's rotary inv_freq in fp32; cast whole, the same weights computed another forward)
        with torch.no_grad():
            for p in cast(torch.nn.Module, self.module).parameters():
                if p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
        return self.module
