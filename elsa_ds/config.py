"""ElsaConfig: the one validated source of truth for an ELSA job, and the DeepSpeed JSON around it.

Precedence, lowest first: field defaults < the embedded demo's profile (only when no --model is
given) < the ``"elsa"`` block of the DeepSpeed JSON < the command line. Every error names the field.
"""
from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from elsa_ds.admm.optimizer import AdmmSettings, Projection
from elsa_ds.admm.projection import NM
from elsa_ds.admm.schedule import LambdaSchedule
from elsa_ds.admm.state import StateDtype
from elsa_ds.errors import ElsaError

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo" / "model"
DEMO_DATASET = "shakespeare"

# Settings that make the embedded default finish in minutes on 2 CPU cores; used only for the demo
# model and only where neither the JSON nor the command line set the field.
DEMO_PROFILE: dict[str, Any] = {
    "dataset": DEMO_DATASET,
    "seqlen": 256,
    "steps": 512,
    "lr": 1e-3,
    "micro_batch": 4,
    "val_windows": 64,
    "gradient_checkpointing": False,
}


class Method(str, Enum):
    elsa = "elsa"              # ADMM on the model's loss under ZeRO-3 (this project)
    magnitude = "magnitude"    # one-shot |W| per layer
    wanda = "wanda"            # one-shot |W|·‖X‖₂ per output row (Sun et al., 2023)
    sparsegpt = "sparsegpt"    # one-shot OBS reconstruction (Frantar & Alistarh, 2023)


ONESHOT_METHODS = ("magnitude", "wanda", "sparsegpt")


class BaseOptimizer(str, Enum):
    auto = "auto"            # DeepSpeedCPUAdam with optimizer offload, torch Adam otherwise
    adam = "adam"            # torch.optim.Adam
    cpu_adam = "cpu_adam"    # deepspeed.ops.adam.DeepSpeedCPUAdam (Adam mode)
    adam8bit = "adam8bit"    # bitsandbytes.optim.Adam8bit (ELSA-L)


class ElsaConfig(BaseModel):
    """Every ELSA setting; JSON block ``"elsa"`` and command-line flags map one-to-one onto fields."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False, validate_assignment=True)

    method: Method = Field(Method.elsa, description="elsa, or a one-shot baseline: magnitude, wanda, sparsegpt.")
    model: str = Field(str(DEMO_MODEL_DIR), description="Hub id or local directory of the causal LM to prune.")
    dataset: str = Field("c4", description="c4, wikitext2, shakespeare, a datasets name, or local .txt/.jsonl/.parquet files.")
    sparsity: float = Field(0.7, ge=0.0, lt=1.0, description="Fraction of zeros in every pruned layer, in [0, 1).")
    pattern: str = Field("unstructured", description="unstructured, or N:M (at least N zeros in every M consecutive inputs); N:M fixes the sparsity to N/M.")
    sparsity_profile: str | None = Field(None, description="JSON file {module-name regex: sparsity}: per-layer ratios (first match wins; others get sparsity).")
    init_mask: str | None = Field(None, description="Warm start of ELSA's z: magnitude, wanda, sparsegpt, or a directory of an already pruned model.")
    nsamples: int = Field(128, gt=0, description="Calibration sequences of seqlen tokens for wanda / sparsegpt (and --init_mask wanda|sparsegpt).")
    blocksize: int = Field(128, gt=0, description="SparseGPT column block size.")
    percdamp: float = Field(0.01, ge=0.0, description="SparseGPT dampening, as a fraction of the mean Hessian diagonal.")
    targets: str | None = Field(None, description="Regex over module names selecting the nn.Linear layers to prune; default: every Linear inside the decoder layers.")
    steps: int = Field(4096, gt=0, description="Optimizer steps (global batches).")
    interval: int = Field(32, gt=0, description="Steps between projections z = Π(x + u).")
    lmda: float = Field(0.01, ge=0.0, description="ADMM penalty λ (peak value for linear / cosine schedules).")
    lmda_schedule: LambdaSchedule = Field(LambdaSchedule.constant, description="constant, linear or cosine (0 → λ over the run).")
    projection: Projection = Field(Projection.fisher, description="fisher: score F·(x+u)² with F = Adam's exp_avg_sq; magnitude: (x+u)².")
    z_dtype: StateDtype = Field(StateDtype.fp32, description="Storage of z: fp32, bf16 or fp8 (e4m3, scaled).")
    u_dtype: StateDtype = Field(StateDtype.fp32, description="Storage of u: fp32, bf16 or fp8 (scaled).")
    base_optimizer: BaseOptimizer = Field(BaseOptimizer.auto, description="auto, adam, cpu_adam or adam8bit.")
    lr: float = Field(2e-4, gt=0.0, description="Peak learning rate; decays linearly to lr_final_ratio · lr.")
    lr_final_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Final learning rate as a fraction of lr.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0.0, description="Adam epsilon.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay (0 = plain Adam, as in the paper).")
    seqlen: int = Field(2048, ge=2, description="Tokens per block (BOS included).")
    micro_batch: int | None = Field(None, gt=0, description="Blocks per rank per forward; default: train_micro_batch_size_per_gpu of the JSON.")
    gradient_checkpointing: bool = Field(True, description="Recompute decoder-layer activations in backward (needed to fit 27B activations).")
    seed: int = Field(0, description="Seed of data order and initialization.")
    val_windows: int = Field(128, ge=0, description="Validation windows of seqlen for dense / pruned perplexity (0 = skip).")
    baseline: str = Field("magnitude", description="One-shot baseline evaluated on the same windows: magnitude or none.")
    nvme_path: str | None = Field(None, description="Directory for NVMe offload; overrides nvme_path of offload_param and offload_optimizer.")
    save_interval: int = Field(0, ge=0, description="Steps between checkpoints in OUTPUT_DIR/checkpoints (0 = none).")
    keep_checkpoints: int = Field(2, gt=0, description="Checkpoints kept (newest first).")
    log_interval: int = Field(1, gt=0, description="Steps between progress-bar loss updates.")
    eval_ppl: list[str] = Field(default_factory=list, description="After the job, evaluate the saved model's perplexity on these (wikitext2, c4, local paths), in-process on rank 0.")
    eval_tasks: list[str] = Field(default_factory=list, description="After the job, lm-eval zero-shot tasks on the saved model ('paper' = the seven tasks).")
    eval_include_path: str | None = Field(None, description="Directory of local lm-eval task YAMLs for eval_tasks.")

    @field_validator("eval_ppl", "eval_tasks", mode="before")
    @classmethod
    def _comma_list(cls, v: Any) -> Any:
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @field_validator("model")
    @classmethod
    def _local_model_exists(cls, v: str) -> str:
        path = Path(v).expanduser()
        if v.startswith((".", "/", "~")) and not path.is_dir():
            raise ValueError("no such directory (pass a hub id like google/gemma-2-2b or a saved model directory)")
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError("directory has no config.json (not a saved transformers model)")
        return v

    @field_validator("targets")
    @classmethod
    def _regex_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as err:
                raise ValueError(f"not a valid regular expression: {err}") from None
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
        if v is not None and v not in ONESHOT_METHODS and not (Path(v).expanduser() / "config.json").is_file():
            raise ValueError(f"must be one of {', '.join(ONESHOT_METHODS)} or a directory holding a pruned model (config.json, *.safetensors)")
        return v

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

    @model_validator(mode="after")
    def _init_mask_is_for_elsa(self) -> ElsaConfig:
        if self.init_mask is not None and self.method is not Method.elsa:
            raise ValueError(f"init_mask warm-starts ELSA; it means nothing with method {self.method.value}")
        return self

    @field_validator("baseline")
    @classmethod
    def _known_baseline(cls, v: str) -> str:
        if v not in ("magnitude", "none"):
            raise ValueError("must be 'magnitude' or 'none'")
        return v

    @property
    def is_demo(self) -> bool:
        return Path(self.model).resolve() == DEMO_MODEL_DIR

    @property
    def nm(self) -> NM | None:
        """The N:M pattern, or None for unstructured sparsity."""
        return None if self.pattern == "unstructured" else NM.parse(self.pattern)

    @property
    def target(self) -> float | NM:
        """What every layer is pruned to without a profile: the N:M pattern, or the sparsity."""
        return self.nm or self.sparsity

    def targets_for(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, float | NM]:
        """Each pruned weight's sparsity or N:M pattern (``shapes``: parameter name -> full shape)."""
        from elsa_ds.targets import layer_targets

        profile = load_profile(self.sparsity_profile) if self.sparsity_profile else None
        return layer_targets(shapes, self.sparsity, self.nm, profile)

    def admm_settings(self) -> AdmmSettings:
        return AdmmSettings(
            total_steps=self.steps, interval=self.interval, lmda=self.lmda, lmda_schedule=self.lmda_schedule,
            projection=self.projection, z_dtype=self.z_dtype, u_dtype=self.u_dtype, pattern=self.nm,
        )


def load_profile(path: str | Path) -> dict[str, float]:
    """A per-layer sparsity profile: a JSON object {module-name regex: sparsity in [0, 1)}, in file order.

    OWL-style (one ratio per decoder block, e.g. ``"layers\\.3\\."``) and EvoPress-style (one per module,
    e.g. ``"layers\\.3\\.mlp\\.down_proj"``) profiles are both written this way.
    """
    try:
        profile = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err.msg} at line {err.lineno}") from None
    if not isinstance(profile, dict) or not profile:
        raise ValueError(f"{path} must hold a non-empty JSON object {{regex: sparsity}}")
    for regex, ratio in profile.items():
        try:
            re.compile(regex)
        except re.error as err:
            raise ValueError(f"{path}: {regex!r} is not a valid regular expression ({err})") from None
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
            raise ValueError(f"{path}: sparsity of {regex!r} is {ratio!r}; it must be a number in [0, 1)")
    return {k: float(v) for k, v in profile.items()}


def _format_validation_error(err: ValidationError, where: str) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not field:  # a rule across fields: the message names them
            parts.append(msg)
        elif e["type"] == "extra_forbidden":
            parts.append(f"{field}: unknown setting (known: {', '.join(sorted(ElsaConfig.model_fields))})")
        else:
            parts.append(f"{field}={e.get('input')!r}: {msg}")
    return f"invalid ELSA setting in {where}: " + "; ".join(parts)


def read_ds_config(path: str | Path) -> dict:
    """Load a DeepSpeed JSON, or raise ElsaError naming the file and the problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ElsaError(f"cannot read DeepSpeed config {path}: {err.strerror}; pass an existing JSON file with --deepspeed") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise ElsaError(f"DeepSpeed config {path} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    if not isinstance(cfg, dict):
        raise ElsaError(f"DeepSpeed config {path} must hold a JSON object")
    return cfg


def resolve_config(ds_config: dict, cli: dict[str, Any], source: str = "the DeepSpeed JSON") -> ElsaConfig:
    """Merge defaults, demo profile, the JSON ``elsa`` block and command-line values (None = not given)."""
    block = ds_config.get("elsa", {})
    if not isinstance(block, dict):
        raise ElsaError(f'"elsa" in {source} must be a JSON object')
    given = {k: v for k, v in cli.items() if v is not None}
    merged = {**block, **given}
    model = merged.get("model", str(DEMO_MODEL_DIR))
    if Path(str(model)).expanduser().resolve() == DEMO_MODEL_DIR:
        merged = {**DEMO_PROFILE, **merged}
    try:
        return ElsaConfig(**merged)
    except ValidationError as err:
        raise ElsaError(_format_validation_error(err, f"{source} / command line")) from None
