"""ElsaConfig: the one validated source of truth for every setting of a pruning job.

Each field's docstring is its documentation: the command line (``elsa_ds/cli.py``), the README's flag table
(``python -m elsa_ds.cli --flag-table``) and the error messages are generated from these fields.

Precedence, lowest first: field defaults < the embedded demo's profile (only when no --model is given) < a ``--recipe``
file < the ``"elsa"`` block of the DeepSpeed JSON < the command line."""
from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from elsa_ds.admm.settings import AdmmSettings, Projection
from elsa_ds.admm.projection import NM
from elsa_ds.admm.schedule import LambdaSchedule
from elsa_ds.admm.state import StateDtype
from elsa_ds.data.sampling import Sampling
from elsa_ds.data.sources import DEMO_DATASET, FILE_NOT_MODEL, looks_local
from elsa_ds.data.windows import PplProtocol
from elsa_ds.errors import ElsaError, SettingsError
from elsa_ds.quoting import format_validation_error
from elsa_ds.methods import DENSE, ELSA, Finetune, Method, OneShot, oneshot_names
from elsa_ds.settings.config_checks import bounded_int, cross_checks, exact_kinds, not_a_percentage
from elsa_ds.settings.config_files import (PATH_SETTINGS, CommaList, PathList, check_each_source, comma_list, compile_regex,
                                          load_profile, load_recipe as _load_recipe, name_problem, resume_place, usable_path)
from elsa_ds.targets import LayerGoal, layer_goals

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo" / "model"
NAMED_TEXT_SOURCES = ("wikitext2", "c4", DEMO_DATASET)

# Settings that make the embedded default finish in minutes on 2 CPU cores: for the demo model only, where nothing else set a field
DEMO_PROFILE: dict[str, Any] = {"dataset": DEMO_DATASET, "seqlen": 256, "steps": 512, "micro_batch": 4, "val_windows": 64,
                                "gradient_checkpointing": False}

# What a resumed run must share with the run that wrote its checkpoint.
RESUME_MUST_MATCH = ("model", "method", "finetune", "lora_rank", "lora_alpha", "dataset", "sparsity", "pattern", "sparsity_profile",
                     "init_mask", "init_weights", "targets", "steps", "interval", "hold_steps", "lmda", "lmda_schedule", "balance_mu",
                     "balance_tau", "relaxation", "projection", "z_dtype", "u_dtype", "base_optimizer", "lr", "warmup_steps",
                     "lr_final_ratio", "seqlen", "seed", "val_dataset", "sampling", "ppl_protocol", "val_windows", "freeze_embeddings")
# settings added since checkpoints were first written: their value before then
RESUME_DEFAULTS = {"hold_steps": 0, "init_weights": False, "balance_mu": 1.5, "balance_tau": 2.0, "relaxation": 1.0}


def _group(name: str, metavar: str | None = None) -> dict[str, Any]:
    return {"json_schema_extra": {"group": name, **({"metavar": metavar} if metavar else {})}}


class BaseOptimizer(str, Enum):
    auto = "auto"            # DeepSpeedCPUAdam with optimizer offload, torch Adam otherwise
    adam = "adam"            # torch.optim.Adam
    cpu_adam = "cpu_adam"    # deepspeed.ops.adam.DeepSpeedCPUAdam (Adam mode)
    adam8bit = "adam8bit"    # bitsandbytes.optim.Adam8bit (ELSA-L's 8-bit Adam; the authors' code uses torchao's)
    adam8bit_minifloat = "adam8bit_minifloat"  # elsa_ds's 8-bit Adam in its own minifloat codes: fast on CPU offload


class ElsaConfig(BaseModel):
    """Every setting of a pruning job; the JSON ``"elsa"`` block and the command-line flags map one-to-one onto fields."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    # --- what is pruned, and how ---------------------------------------------------------------------------
    method: Method = Field(Method.elsa, **_group("job"))
    """elsa, a one-shot baseline (magnitude, wanda, sparsegpt: layer by layer in one process, or retrained with --finetune),
    or dense (no pruning: the control, with --finetune)."""
    model: str = Field(str(DEMO_MODEL_DIR), **_group("job", "ID_OR_DIR"))
    """Hub id or local directory of the causal LM to prune [the embedded Shakespeare Gemma-2 demo]."""
    random_init: bool = Field(False, **_group("job"))
    """Build the model from its config.json with random weights instead of loading weights (benchmarks, scale tests)."""
    sparsity: float = Field(0.7, ge=0.0, lt=1.0, **_group("sparsity"))
    """Fraction of zeros in every pruned layer, in [0, 1)."""
    pattern: str = Field("unstructured", **_group("sparsity", "N:M"))
    """unstructured, or N:M: at least N zeros in every M consecutive inputs of a row; fixes the sparsity to N/M."""
    sparsity_profile: str | None = Field(None, **_group("sparsity", "FILE"))
    """JSON file {module-name regex: sparsity}: per-layer ratios, first match wins, other layers take sparsity."""
    targets: str | None = Field(None, **_group("sparsity", "REGEX"))
    """Regex over module names of the nn.Linear layers to prune [every Linear inside the decoder layers]."""
    init_mask: str | None = Field(None, **_group("sparsity", "METHOD_OR_DIR"))
    """Warm start of ELSA's z from a magnitude, wanda or sparsegpt mask, or a pruned model directory; none: no warm start.
    Unset with lr unset: the defaults rule's (sparsegpt with init_weights up to 90 % sparsity under 2048 steps) [from the
    defaults rule; none with your lr]."""
    init_weights: bool = Field(False, **_group("sparsity"))
    """With init_mask: x starts from its pruned weights too (SparseGPT's reconstruction; a directory's): z₀ = x₀,
    u₀ = 0 [from the defaults rule; off with your lr]."""
    nsamples: int = Field(128, gt=0, **_group("sparsity"))
    """Calibration sequences of seqlen tokens for wanda / sparsegpt (and --init_mask wanda|sparsegpt)."""
    blocksize: int = Field(128, gt=0, **_group("sparsity"))
    """SparseGPT column block size."""
    percdamp: float = Field(0.01, ge=0.0, **_group("sparsity"))
    """SparseGPT dampening, as a fraction of the mean Hessian diagonal."""

    # --- retraining after a one-shot mask (and the dense control) --------------------------------------------
    finetune: Finetune | None = Field(None, **_group("finetune"))
    """Train after the one-shot mask, the mask held fixed, on ELSA's data, batch and lr schedule: full (every weight, pruned
    entries exactly zero) or lora (adapters on the pruned layers, merged with the mask re-applied) [none]."""
    finetune_steps: int | None = Field(None, gt=0, **_group("finetune"))
    """Optimizer steps of --finetune (global batches, like ELSA's --steps) [steps]."""
    lora_rank: int = Field(8, gt=0, **_group("finetune"))
    """Rank r of the LoRA adapters (--finetune lora)."""
    lora_alpha: float = Field(16.0, gt=0.0, **_group("finetune"))
    """LoRA scaling α: the update is (α / r)·B·A."""

    # --- data ----------------------------------------------------------------------------------------------
    dataset: str = Field("c4", **_group("data", "SOURCE"))
    """c4, wikitext2, shakespeare, a datasets name with a text column, or local .txt/.md/.jsonl/.parquet files; a local
    directory is split by file names (train/validation/test), otherwise 10% of whole documents are held out for
    validation [c4; demo: shakespeare]."""
    val_dataset: str | None = Field(None, **_group("data", "SOURCE"))
    """Validation text instead of the held-out part of dataset (read as launch/evaluate.py --ppl reads it); dataset then
    trains on all of its documents; the report's perplexities and --select_every score on it."""
    sampling: Sampling = Field(Sampling.auto, **_group("data"))
    """Training sequences: crop (the ELSA authors' loader: random documents longer than seqlen, a random window of
    each; Gemma: BOS + seqlen-1 tokens), pack (documents joined by EOS in BOS-first blocks), auto (crop for c4 and
    wikitext2, pack otherwise)."""
    seqlen: int = Field(2048, ge=2, **_group("data"))
    """Tokens per training block and validation window."""
    batch_size: int | None = Field(None, gt=0, **_group("data"))
    """Global batch in sequences; overrides the DeepSpeed JSON's train_batch_size (required when that is "auto")."""
    micro_batch: int | None = Field(None, gt=0, **_group("data"))
    """Sequences per rank per forward [the JSON's train_micro_batch_size_per_gpu]; on a CPU, the whole batch at once is fastest."""
    seed: int = Field(0, **_group("data"))
    """Seed of data order, calibration sampling and initialization."""
    val_windows: int = Field(128, ge=0, **_group("data"))
    """Validation windows for dense / one-shot / pruned perplexity in the report (0 skips)."""
    ppl_protocol: PplProtocol = Field(PplProtocol.auto, **_group("data"))
    """Perplexity windows (the report's, eval_ppl's, launch/evaluate.py's): stream (SparseGPT/Wanda: the text tokenized
    once, consecutive windows), window (the ELSA authors' Gemma protocol: the same windows, BOS overwrites each first
    token), prepend (their code at 2947127: BOS + each window's first L-1 tokens), auto (window for Gemma, else stream)."""
    baseline: Literal["magnitude", "none"] = Field("magnitude", **_group("data"))
    """One-shot baseline the report evaluates on the same windows: magnitude or none (a warm start is compared instead)."""

    # --- ADMM ----------------------------------------------------------------------------------------------
    steps: int = Field(4096, gt=0, **_group("admm"))
    """Optimizer steps (global batches)."""
    interval: int = Field(32, gt=0, **_group("admm"))
    """Steps between projections z = Π(x + u), u = u + x − z."""
    hold_steps: int = Field(0, ge=0, **_group("admm"))
    """Train the last this many steps inside a fixed mask: the hard projection x = Π(x) comes that many steps before
    the end, then no penalty and the pruned entries held at exactly 0 (the masked retraining of ADMM pruning; not in
    the ELSA paper). λ's schedule runs over the steps before it. 0 = the paper's method [from the defaults rule: half
    the steps (fewer where the rest would make no z, u update) where its pruned start at ≥ 80 % takes retraining's lr
    (below ~450 steps); else 0]."""
    select_every: int = Field(0, ge=0, **_group("admm"))
    """Score the hard projection Π(x) on the validation windows every this many projections and export the best one (0 = export the
    final Π(x)); with --init_weights the start a one-shot --init_mask pruned at the job's goals is scored too, as step 0 (no folder's)."""
    select_patience: int = Field(0, ge=0, **_group("admm"))
    """Stop once this many scored projections in a row did not improve on the best (0 = never stop early)."""
    lmda: float = Field(0.01, ge=0.0, **_group("admm"))
    """ADMM penalty λ (the peak of a linear or cosine schedule; at most 1e3) [from the defaults rule, elsa_ds/settings/defaults.py]."""
    lmda_schedule: LambdaSchedule = Field(LambdaSchedule.constant, **_group("admm"))
    """constant, linear or cosine (0 → λ over the run), or adaptive: residual balancing, a λ per layer starting at lmda,
    × or ÷ balance_tau at each projection as the layer's residuals say (the authors' adaptive_boyd; eager path, slower on
    CPU); the scaled dual is rescaled when λ changes [from the defaults rule]."""
    balance_mu: float = Field(1.5, gt=1.0, **_group("admm"))
    """adaptive λ: a layer's λ grows when ‖x − z‖/‖x‖ exceeds this times ‖z − z_prev‖/‖z_prev‖, and shrinks in the
    opposite case (the authors' optimizer's default; their command line's is 10)."""
    balance_tau: float = Field(2.0, gt=1.0, **_group("admm"))
    """adaptive λ: the factor a layer's λ moves by (the authors' default)."""
    relaxation: float = Field(1.0, gt=0.0, lt=2.0, **_group("admm"))
    """Over-relaxation α of the dual update u = u + α (x − z) (the authors' --admm_alpha; 1 = plain ADMM; not Boyd et
    al.'s form, so their 1.5-1.8 does not carry over); α ≠ 1 takes the eager projection (slower on CPU)."""
    projection: Projection = Field(Projection.fisher, **_group("admm"))
    """fisher: keep the largest F·(x+u)², F = the optimizer's second moment; magnitude: the largest (x+u)²."""
    z_dtype: StateDtype = Field(StateDtype.fp32, **_group("admm"))
    """Storage of z: fp32, bf16 or fp8 (e4m3, scaled)."""
    u_dtype: StateDtype = Field(StateDtype.fp32, **_group("admm"))
    """Storage of u: fp32, bf16 or fp8 (scaled)."""

    # --- optimizer -----------------------------------------------------------------------------------------
    base_optimizer: BaseOptimizer = Field(BaseOptimizer.auto, **_group("optimizer"))
    """auto (DeepSpeedCPUAdam with optimizer offload, else torch Adam), adam, cpu_adam, adam8bit or adam8bit_minifloat."""
    lr: float = Field(2e-4, gt=0.0, **_group("optimizer"))
    """Peak learning rate; linear decay to lr_final_ratio · lr [from the defaults rule, elsa_ds/settings/defaults.py]."""
    lr_final_ratio: float = Field(0.0, ge=0.0, le=1.0, **_group("optimizer"))
    """Final learning rate as a fraction of lr."""
    warmup_steps: int = Field(0, ge=0, **_group("optimizer"))
    """Linear learning-rate warm-up steps; with the rule's lr, 10 % of a run under 2048 steps [from the defaults rule]."""
    betas: tuple[float, float] = Field((0.9, 0.999), **_group("optimizer", "B1 B2"))
    """Adam betas."""
    eps: float = Field(1e-8, gt=0.0, **_group("optimizer"))
    """Adam epsilon (at least 1e-30)."""
    weight_decay: float = Field(0.0, ge=0.0, **_group("optimizer"))
    """Decoupled weight decay (0 = plain Adam, the ELSA authors' code default)."""
    gradient_checkpointing: bool = Field(True, **_group("optimizer"))
    """Recompute decoder-layer activations in backward (what lets 27B activations fit) [on; demo: off]."""
    freeze_embeddings: bool = Field(False, **_group("optimizer"))
    """Train neither the token embedding nor the LM head (no gradient, master, moments, z, u): at a 256k vocabulary the
    embedding is the largest tensor, and NVMe offload sizes every optimizer swap buffer by it."""

    # --- engine, checkpoints, logging ------------------------------------------------------------------------
    nvme_path: str | None = Field(None, **_group("engine", "DIR"))
    """NVMe offload directory; overrides nvme_path of offload_param and offload_optimizer in the JSON."""
    leaf_layers: bool = Field(False, **_group("engine"))
    """ZeRO-3 hooks each decoder layer whole (its parameters fetched at once, no hooks inside it): the same math, less host
    time a step where many small modules bound it (a small model on a GPU). Not with offload_param on NVMe."""
    save_interval: int = Field(0, ge=0, **_group("engine"))
    """Steps between checkpoints in OUTPUT_DIR/checkpoints (0 = none)."""
    keep_checkpoints: int = Field(2, gt=0, **_group("engine"))
    """Checkpoints kept, newest first."""
    log_interval: int = Field(1, gt=0, **_group("engine"))
    """Steps between progress-bar updates."""

    # --- evaluation of the saved model at the end ------------------------------------------------------------
    eval_ppl: PathList = Field(default_factory=list, **_group("evaluation", "LIST"))
    """Comma list of wikitext2, c4, shakespeare or local .txt/.md/.jsonl/.parquet paths or folders: perplexity of the
    saved model, rank 0 alone at the end."""
    eval_tasks: CommaList = Field(default_factory=list, **_group("evaluation", "LIST"))
    """Comma list of lm-eval tasks run 0-shot on the saved model ('paper' = the seven tasks of the papers)."""
    eval_include_path: str | None = Field(None, **_group("evaluation", "DIR"))
    """Directory of local lm-eval task YAMLs for eval_tasks."""

    @field_validator("sparsity", mode="before")
    @classmethod
    def _a_fraction(cls, v: Any) -> Any:
        return not_a_percentage(v)

    @field_validator("eval_ppl")
    @classmethod
    def _eval_sources_exist(cls, v: list[str]) -> list[str]:
        missing = [s for s in v if s not in NAMED_TEXT_SOURCES and not Path(s).expanduser().exists()]
        if missing:
            raise ValueError(f"{', '.join(map(repr, missing))}: no such file or directory (named sources: "
                             f"{', '.join(NAMED_TEXT_SOURCES)}; a comma separates the entries)")
        return v

    @field_validator("dataset", "val_dataset")
    @classmethod
    def _local_dataset_exists(cls, v: str | None) -> str | None:
        if v is not None and looks_local(v) and not Path(v).expanduser().exists():
            raise ValueError("no such file or directory (or give c4, wikitext2, shakespeare or a datasets name)")
        return v

    @field_validator("model")
    @classmethod
    def _local_model_exists(cls, v: str) -> str:
        path = Path(v).expanduser()
        if path.is_file():  # a walk: a weight file read as a config
            raise ValueError(FILE_NOT_MODEL)
        if v.startswith((".", "/", "~")) and not path.is_dir():
            raise ValueError("no such directory (pass a hub id like google/gemma-2-2b or a saved model directory)")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError("directory has no config.json (not a saved transformers model)")
        return v

    @field_validator("targets")
    @classmethod
    def _regex_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            compile_regex(v)  # ValueError: not a regex, or one that may match in exponential time
        return v

    @field_validator("pattern")
    @classmethod
    def _known_pattern(cls, v: str) -> str:
        if v != "unstructured":
            NM.parse(v)  # ValueError names the problem
        return v

    @field_validator("sparsity_profile")
    @classmethod
    def _profile_readable(cls, v: str | None) -> str | None:
        if v is not None:
            load_profile(v)
        return v

    @field_validator("init_mask")
    @classmethod
    def _known_init_mask(cls, v: str | None) -> str | None:
        if v is not None and v not in ("none", *oneshot_names()) and not (Path(v).expanduser() / "config.json").is_file():
            raise ValueError(f"must be one of {', '.join(oneshot_names())}, none or a directory holding a pruned model "
                             "(config.json, *.safetensors)")
        return None if v == "none" else v  # none: no warm start, said explicitly

    @model_validator(mode="before")
    @classmethod
    def _pattern_fixes_sparsity(cls, data: Any) -> Any:
        """N:M means sparsity N/M; a different sparsity or a per-layer profile beside it is a contradiction."""
        if not isinstance(data, dict) or data.get("pattern", "unstructured") == "unstructured":
            return data
        try:
            nm = NM.parse(str(data["pattern"]))
        except ValueError:
            return data  # the field validator reports it
        if data.get("sparsity") is not None and abs(float(data["sparsity"]) - nm.ratio) > 1e-12:
            raise ValueError(f"pattern {nm} means sparsity {nm.ratio:g}; drop sparsity={data['sparsity']} or set it to {nm.ratio:g}")
        if data.get("sparsity_profile") is not None:
            raise ValueError(f"pattern {nm} fixes every layer's sparsity; a sparsity_profile cannot be combined with it")
        return {**data, "sparsity": nm.ratio}

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("Adam's betas are decay rates: each must be in [0, 1) (the usual 0.9 0.999)")
        return v

    @model_validator(mode="after")
    def _sparsity_prunes_something(self) -> ElsaConfig:
        if self.sparsity == 0.0 and self.nm is None and self.sparsity_profile is None and self.method.value != DENSE:
            raise ValueError("sparsity 0 prunes nothing: give a sparsity in (0, 1), e.g. --sparsity 0.7 (the unpruned "
                             "control is --method dense --finetune full)")
        return self

    @model_validator(mode="after")
    def _init_mask_is_for_elsa(self) -> ElsaConfig:
        if self.init_mask is not None and self.method is not Method.elsa:
            raise ValueError(f"init_mask warm-starts ELSA; it means nothing with method {self.method.value}")
        if self.init_weights and self.init_mask is None:
            raise ValueError("init_weights starts x from the pruned weights of --init_mask; set --init_mask too")
        return self

    @model_validator(mode="after")
    def _finetune_fits_method(self) -> ElsaConfig:
        if self.finetune is not None and self.method is Method.elsa:
            raise ValueError("finetune retrains a one-shot mask (--method magnitude|wanda|sparsegpt) or the dense model "
                             "(--method dense); ELSA trains on its own")
        if self.method.value == DENSE and self.finetune is None:
            raise ValueError("method dense is the unpruned control: give it --finetune full or lora (the dense model itself "
                             "needs no job: evaluate it with launch/evaluate.py)")
        if self.finetune_steps is not None and self.finetune is None:
            raise ValueError("finetune_steps counts --finetune steps; set --finetune full or lora with a one-shot --method "
                             "(magnitude, wanda, sparsegpt) or dense, or drop it")
        if (self.select_every or self.select_patience or self.hold_steps) and self.method is not Method.elsa:
            raise ValueError("select_every / select_patience / hold_steps shape ELSA's run; they mean nothing with method "
                             f"{self.method.value}")
        if self.select_patience and not self.select_every:
            raise ValueError("select_patience counts scored projections; set select_every too")
        if self.select_every and not self.val_windows:
            raise ValueError("select_every scores projections on the validation windows; val_windows must be > 0")
        if self.hold_steps and (self.hold_steps >= self.steps or self.select_every):
            raise ValueError(f"hold_steps ({self.hold_steps}) ends ELSA's run inside a fixed mask: it must be below steps "
                             f"({self.steps}), and select_every (which picks among the projections before it) must be 0")
        return self

    _usable_paths = field_validator(*PATH_SETTINGS, mode="before")(usable_path)  # before their checks ask the file system
    _cross_checks = model_validator(mode="after")(cross_checks)  # a schedule the run reaches, whole --init_mask files
    _bounded_ints = field_validator("*")(bounded_int)  # every int: exact as a float (the estimates'); the seed: every seeder's
    _exact_kinds = field_validator("*", mode="before")(exact_kinds)  # a boolean or a number where one is taken, and only there

    @property
    def is_demo(self) -> bool:
        return Path(self.model).resolve() == DEMO_MODEL_DIR

    @property
    def oneshot(self) -> OneShot | None:
        """The one-shot method, or None for ELSA and the dense control."""
        return None if self.method.value in (ELSA, DENSE) else OneShot(self.method.value)

    @property
    def nm(self) -> NM | None:
        """The N:M pattern, or None for unstructured sparsity."""
        return None if self.pattern == "unstructured" else NM.parse(self.pattern)

    @property
    def goal(self) -> LayerGoal:
        """What every layer is pruned to without a profile: the N:M pattern, or the sparsity."""
        return self.nm or self.sparsity

    def layer_goals(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, LayerGoal]:
        """Each pruned weight's sparsity or N:M pattern (``shapes``: parameter name -> full shape)."""
        profile = load_profile(self.sparsity_profile) if self.sparsity_profile else None
        return layer_goals(shapes, self.sparsity, self.nm, profile)

    def admm_settings(self) -> AdmmSettings:
        return AdmmSettings(total_steps=self.steps, interval=self.interval, lmda=self.lmda, lmda_schedule=self.lmda_schedule,
                            projection=self.projection, z_dtype=self.z_dtype, u_dtype=self.u_dtype, pattern=self.nm,
                            hold_steps=self.hold_steps, balance_mu=self.balance_mu, balance_tau=self.balance_tau,
                            relaxation=self.relaxation)

    def resume_fingerprint(self, world_size: int) -> dict[str, Any]:
        """Settings a resumed run must share with the run that wrote the checkpoint."""
        settings = {k: resume_place(k, v) for k, v in self.model_dump(mode="json").items() if k in RESUME_MUST_MATCH}
        if self.sparsity_profile:  # the ratios, not the path: an edited profile is a different run
            settings["sparsity_profile"] = load_profile(self.sparsity_profile)
        return {"world_size": world_size, **settings}


def load_recipe(name_or_path: str) -> dict[str, Any]:
    """A recipe's settings, checked against ElsaConfig's fields (see ``config_files.load_recipe``)."""
    return _load_recipe(name_or_path, set(ElsaConfig.model_fields))


def resolve_config(ds_config: dict, cli: dict[str, Any], source: str = "the DeepSpeed JSON", recipe: dict[str, Any] | None = None,
                   recipe_source: str = "the recipe", given_as: str = "the command line") -> ElsaConfig:
    """Merge defaults, the demo's profile, a recipe, the JSON's ``elsa`` block and the command line (None: not given)."""
    block = ds_config.get("elsa", {})
    if not isinstance(block, dict):
        raise ElsaError(f'"elsa" in {source} must be a JSON object')
    given = {k: v for k, v in cli.items() if v is not None}
    check_each_source(ElsaConfig, [(recipe_source, recipe or {}), (f'the "elsa" block of {source}', block)])
    merged = {**(recipe or {}), **block, **given}
    if not name_problem(model := str(merged.get("model", DEMO_MODEL_DIR))) and Path(model).expanduser().resolve() == DEMO_MODEL_DIR:
        merged = {**DEMO_PROFILE, **merged}  # its micro batch over the JSON's (the shipped JSONs' 1 too), as the README says
    try:
        return ElsaConfig(**merged)
    except ValidationError as err:
        where = [w for w, used in ((recipe_source, recipe), (source, block), (given_as, given)) if used]
        raise SettingsError(format_validation_error(err, " / ".join(where) or "the defaults", ElsaConfig)) from None
