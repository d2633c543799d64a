"""One typed view of a DeepSpeed JSON: where things are offloaded, the batch split, and the engine's own config.

Every problem a config has is reported at once, in one error. ``"auto"`` values (transformers' stock ZeRO-3
JSONs) are resolved as transformers' integration resolves them (``integrations/deepspeed.py``:
``trainer_config_process`` / ``trainer_config_finalize``), from elsa_ds's own settings and the model's
hidden size; optimizer and scheduler blocks are dropped when every value in them is "auto" (elsa_ds builds
both from its own settings) and refused when they hold values of their own.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import direct_io_problem
from elsa_ds.monitor import DEFAULT_JOB_NAME, FILE_MONITORS
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.config_files import read_json_object
from elsa_ds.zero.ds_values import check_values

AUTO = "auto"
# DeepSpeed needs these to accept a wrapper around an arbitrary torch optimizer under offload
CLIENT_OPTIMIZER_FLAGS = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
# swapped per sub-group in one optimizer step: fp32 master, exp_avg, exp_avg_sq, z, u, and the gradient
NVME_OPTIMIZER_BUFFERS = 6
# optimizer-block parameters and the ElsaConfig field each must agree with
OPTIMIZER_PARAMS = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}


def shipped_configs() -> dict[str, Path]:
    """The DeepSpeed configs that ship with elsa_ds, by name (``zero3_offload`` ...)."""
    root = Path(str(resources.files("elsa_ds") / "ds_configs"))
    return {p.stem: p for p in sorted(root.glob("*.json"))}


def resolve_path(name_or_path: str | Path) -> Path:
    """A config by path, or a shipped config by name (with or without ``.json``)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = shipped_configs()
    stem = path.name.removesuffix(".json")
    if path.parent == Path(".") and stem in shipped:
        return shipped[stem]
    raise ElsaError(f"--deepspeed {name_or_path}: no such file, and not a shipped config ({', '.join(shipped)})")


@dataclass
class DsConfig:
    """A typed view of a DeepSpeed JSON holding the dict it reads: as read (:meth:`load`), or resolved for one run
    (:meth:`resolve`: the engine's own config, the one object a job passes to everything that builds or asks the engine)."""

    raw: dict[str, Any]
    source: str = "the DeepSpeed JSON"

    @classmethod
    def load(cls, name_or_path: str | Path) -> DsConfig:
        path = resolve_path(name_or_path)
        raw = read_json_object(path, "DeepSpeed config", "pass an existing JSON file or a shipped name with --deepspeed")
        _check_sections(raw, path)
        return cls(raw, str(name_or_path))

    @property
    def zero(self) -> dict[str, Any]:
        zero = self.raw.get("zero_optimization", {})
        return zero if isinstance(zero, dict) else {}

    @property
    def stage(self) -> Any:
        return self.zero.get("stage")

    @property
    def param_device(self) -> str:
        return str(self.zero.get("offload_param", {}).get("device", "none"))

    @property
    def optimizer_device(self) -> str:
        return str(self.zero.get("offload_optimizer", {}).get("device", "none"))

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.param_device, self.optimizer_device)

    @property
    def nvme_paths(self) -> set[str]:
        """The nvme_path of each section offloaded to NVMe (of a resolved config: --nvme_path applied)."""
        sections = (self.zero.get(key, {}) for key in ("offload_param", "offload_optimizer"))
        return {str(Path(str(s["nvme_path"])).expanduser().resolve()) for s in sections
                if isinstance(s, dict) and s.get("device") == "nvme" and s.get("nvme_path")}  # one folder, one name

    @property
    def optimizer_on_nvme(self) -> bool:
        return self.optimizer_device == "nvme"

    @property
    def optimizer_offloaded(self) -> bool:
        return self.optimizer_device in ("cpu", "nvme")

    @property
    def bf16(self) -> bool:
        return self.raw.get("bf16", {}).get("enabled") in (True, AUTO)

    @property
    def train_batch_size(self) -> int:
        """The global batch in sequences (of a resolved config)."""
        return self.raw["train_batch_size"]

    @property
    def micro_batch_size(self) -> int:
        """Sequences per rank per forward pass (of a resolved config)."""
        return self.raw["train_micro_batch_size_per_gpu"]

    def global_batch(self, cfg: ElsaConfig) -> Any:
        return cfg.batch_size or self.raw.get("train_batch_size")

    def micro_batch(self, cfg: ElsaConfig) -> Any:
        value = self.raw.get("train_micro_batch_size_per_gpu", 1)
        return cfg.micro_batch or (1 if value == AUTO else value)

    def problems(self, cfg: ElsaConfig, world_size: int, hidden_size: int | None, check_paths: bool = True) -> list[str]:
        """Everything that keeps this config from running ``cfg`` on ``world_size`` ranks (empty: it can); ``check_paths``:
        also that the NVMe paths exist on this machine."""
        found = []
        if self.stage != 3:
            found.append(f"zero_optimization.stage must be 3 (got {self.stage!r}); elsa_ds partitions the ADMM states with ZeRO-3")
        if self.raw.get("fp16", {}).get("enabled") is True:
            found.append('fp16 is not supported (its loss scaler skips optimizer steps, which would desynchronize the ADMM '
                         'schedule); use "bf16": {"enabled": true}')
        if float(self.zero.get("offload_optimizer", {}).get("ratio", 1.0)) < 1.0:
            found.append("offload_optimizer.ratio < 1 (partial offload) is not supported: remove it or set it to 1.0")
        found += self._batch_problems(cfg, world_size)
        found += self._block_problems(cfg)
        found += _nvme_problems(self.zero, cfg.nvme_path, check_paths)
        if hidden_size is None:
            found += [f"{key} is \"auto\" and the model's hidden size is unknown; set a number" for key in _auto_buckets(self.zero)]
        found += [f'{key} is "auto" and elsa_ds cannot resolve it; set a value' for key in _unresolvable_autos(self.raw)]
        return found

    def base_optimizer_problem(self, cfg: ElsaConfig, device: str) -> str | None:
        """Why ``cfg``'s base optimizer cannot step under this config on ``device`` (cuda or cpu), or None:
        DeepSpeedCPUAdam steps host tensors, which a GPU job has only with offload_optimizer."""
        if cfg.base_optimizer.value != "cpu_adam" or self.optimizer_offloaded or device != "cuda":
            return None
        return (f"--base_optimizer cpu_adam (DeepSpeedCPUAdam) steps tensors in host memory, but {self.source} keeps the "
                "optimizer on the GPU (no offload_optimizer): its first step would fail after the model loads; use "
                "--base_optimizer adam (auto picks it here) or a config that offloads the optimizer (zero3_offload)")

    def _batch_problems(self, cfg: ElsaConfig, world_size: int) -> list[str]:
        global_batch, micro = self.global_batch(cfg), self.micro_batch(cfg)
        if global_batch == AUTO or global_batch is None:
            return ['train_batch_size is missing or "auto": set it (the global batch in sequences) in the JSON or with --batch_size']
        if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch <= 0:
            return [f"train_batch_size must be a positive integer, got {global_batch!r}"]
        if not isinstance(micro, int) or micro <= 0:
            return [f"train_micro_batch_size_per_gpu must be a positive integer, got {micro!r}"]
        if global_batch % (micro * world_size):
            unit = micro * world_size
            origin = f"train_batch_size {global_batch}"
            if cfg.batch_size:  # a recipe's, the elsa block's or the command line's: the JSON's own value gives way to it
                origin = (f"the global batch {global_batch} (batch_size of the settings: --batch_size, a recipe or the elsa "
                          f"block; the JSON's train_batch_size {self.raw.get('train_batch_size')!r} gives way to it)")
            return [f"{origin} is not a multiple of micro batch {micro} x {world_size} ranks; pass --batch_size "
                    f"{-(-global_batch // unit) * unit} (or another multiple of {unit}), "
                    f"{'a smaller --micro_batch, ' if micro > 1 else ''}or fewer ranks"]
        accumulation, derived = self.raw.get("gradient_accumulation_steps", AUTO), global_batch // (micro * world_size)
        if accumulation != AUTO and accumulation != derived:
            return [f"gradient_accumulation_steps {accumulation!r} disagrees with train_batch_size {global_batch} / (micro "
                    f"batch {micro} x {world_size} ranks) = {derived}: elsa_ds derives it from the global batch; set it to "
                    f'"auto" or {derived}, or remove it']
        return []

    def _block_problems(self, cfg: ElsaConfig) -> list[str]:
        found = []
        optimizer = self.raw.get("optimizer")
        if optimizer is not None:
            if str(optimizer.get("type", "adam")).lower() not in ("adam", "adamw"):
                found.append(f'optimizer type {optimizer.get("type")!r}: elsa_ds steps Adam (see --base_optimizer); '
                             'remove the "optimizer" block')
            for key, value in optimizer.get("params", {}).items():
                field = OPTIMIZER_PARAMS.get(key)
                ours = getattr(cfg, field) if field else None
                if value != AUTO and (field is None or _differs(value, ours)):
                    flag = " ".join(map(str, value)) if isinstance(value, list) else value  # --betas 0.9 0.95 (an audit)
                    hint = f"pass --{field} {flag}" if field else "elsa_ds has no such setting"
                    found.append(f'optimizer.params.{key}={value!r}: elsa_ds builds the optimizer from its own settings; {hint} '
                                 f'or set it to "auto"')
        scheduler = self.raw.get("scheduler")
        if scheduler is not None:
            own = {k: v for k, v in scheduler.get("params", {}).items() if v != AUTO}
            if own:
                found.append(f"scheduler.params {own}: elsa_ds's learning rate decays linearly from --lr after --warmup_steps; "
                             'remove the "scheduler" block or set its values to "auto"')
        return found

    def check(self, cfg: ElsaConfig, world_size: int, hidden_size: int | None, check_paths: bool = True) -> None:
        """Raise ElsaError naming every one of :meth:`problems`, numbered, in one line."""
        if found := self.problems(cfg, world_size, hidden_size, check_paths):
            numbered = "; ".join(f"({i}) {p}" for i, p in enumerate(found, 1))
            raise ElsaError(f"DeepSpeed config {self.source} cannot be used as it is: {numbered}")

    def engine_config(self, cfg: ElsaConfig, world_size: int, hidden_size: int | None = None,
                      check_paths: bool = True, largest_param: int | None = None) -> dict[str, Any]:
        """The config the engine gets: checked (``check_paths``: the NVMe paths too), autos resolved (the parameter
        swapper's buffer from ``largest_param``, the model's largest parameter), batch split derived from the global batch."""
        self.check(cfg, world_size, hidden_size, check_paths)
        ds = copy.deepcopy({k: v for k, v in self.raw.items() if k not in ("elsa", "optimizer", "scheduler")})
        zero = ds.setdefault("zero_optimization", {})
        _apply_nvme_path(zero, cfg.nvme_path)
        if hidden_size is not None:
            _resolve_buckets(zero, hidden_size)
        if zero.get("offload_param", {}).get("buffer_size") == AUTO:
            if largest_param is None and zero["offload_param"].get("device") == "nvme":  # DeepSpeed would take 1e8 silently
                raise ElsaError('zero_optimization.offload_param.buffer_size is "auto", which is resolved from the model\'s '
                                "largest parameter, unknown here; set a number of elements")
            # unused off NVMe: DeepSpeed's default stands in when the shape is unknown
            zero["offload_param"]["buffer_size"] = DEFAULT_PARAM_BUFFER if largest_param is None else \
                param_buffer_size(zero, largest_param, world_size)
        global_batch, micro = self.global_batch(cfg), self.micro_batch(cfg)
        ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"] = global_batch, micro
        ds["gradient_accumulation_steps"] = global_batch // (micro * world_size)
        if ds.get("gradient_clipping") == AUTO:
            ds["gradient_clipping"] = 1.0  # transformers' max_grad_norm default
        for key, value in (("bf16", True), ("fp16", False)):
            if ds.get(key, {}).get("enabled") == AUTO:
                ds[key]["enabled"] = value
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        ds.update(CLIENT_OPTIMIZER_FLAGS)
        ds.setdefault("steps_per_print", 10**9)
        ds.setdefault("wall_clock_breakdown", False)
        return ds

    def resolve(self, cfg: ElsaConfig, world_size: int, hidden_size: int | None = None, check_paths: bool = True,
                largest_param: int | None = None) -> DsConfig:
        """:meth:`engine_config` as a view: the one DeepSpeed config object a job builds and passes on."""
        return DsConfig(self.engine_config(cfg, world_size, hidden_size, check_paths, largest_param), self.source)


def _differs(value: Any, ours: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return list(value) != list(ours)
    return value != ours


def linear_wrapped(zero: dict[str, Any]) -> bool:
    """Whether ZeRO-3 routes F.linear through DeepSpeed's wrapper (``memory_efficient_linear``, on by default), read as
    DeepSpeed's pydantic reads a bool: "false", "0", "off", "no" (any case) and 0 are off."""
    value = zero.get("memory_efficient_linear", True)
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "off", "no", "f", "n")
    return bool(value)


_BUCKETS = {  # "auto" -> value from the hidden size h, as transformers' HfTrainerDeepSpeedConfig sets them
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _auto_buckets(zero: dict[str, Any]) -> list[str]:
    return [f"zero_optimization.{k}" for k in _BUCKETS if zero.get(k) == AUTO]


def _resolve_buckets(zero: dict[str, Any], hidden_size: int) -> None:
    for key, rule in _BUCKETS.items():
        if zero.get(key) == AUTO:
            zero[key] = rule(hidden_size)


DEFAULT_PARAM_BUFFER = 1e8  # DeepSpeed's offload_param.buffer_size


def param_buffer_size(zero: dict[str, Any], largest_param: int, world_size: int) -> float:
    """offload_param.buffer_size in elements: as given, or for "auto" the largest parameter's partition on
    ``world_size`` ranks (DeepSpeed's NVMe swapper holds one in each buffer), at least DeepSpeed's default."""
    value = zero.get("offload_param", {}).get("buffer_size", DEFAULT_PARAM_BUFFER)
    return float(value) if value != AUTO else max(DEFAULT_PARAM_BUFFER, float(-(-largest_param // world_size)))


RESOLVED_AUTOS = {("train_batch_size",), ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",),
                  ("gradient_clipping",), ("bf16", "enabled"), ("fp16", "enabled"), ("zero_optimization", "offload_param", "buffer_size"),
                  *(("zero_optimization", k) for k in _BUCKETS)}


def _unresolvable_autos(raw: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[str]:
    """Dotted keys holding "auto" that no rule resolves (the optimizer, scheduler and elsa blocks aside)."""
    found = []
    for key, value in raw.items():
        path = (*prefix, key)
        if not prefix and key in ("optimizer", "scheduler", "elsa"):
            continue
        if isinstance(value, dict):
            found += _unresolvable_autos(value, path)
        elif value == AUTO and path not in RESOLVED_AUTOS:
            found.append(".".join(path))
    return found


SECTIONS = ("zero_optimization", "bf16", "fp16", "elsa", "checkpoint", "optimizer", "scheduler", "tensorboard", "csv_monitor",
            "flops_profiler", "aio", "data_types")
# keys whose values DeepSpeed imports as Python (runtime/torch_autocast.py: importlib.import_module of each name): a
# config file is data, so they are refused (unset, DeepSpeed's own list of module classes applies)
CODE_KEYS = (("torch_autocast", "lower_precision_safe_modules"),)


def _check_sections(raw: dict[str, Any], path: Path) -> None:
    """ElsaError naming the file where a section that must be a JSON object is something else (the readers index it)."""
    zero = raw.get("zero_optimization", {})
    nested = [("zero_optimization." + k, zero[k]) for k in ("offload_param", "offload_optimizer")
              if isinstance(zero, dict) and k in zero]
    for name, value in [*((k, raw[k]) for k in SECTIONS if k in raw), *nested]:
        if not isinstance(value, dict):
            raise ElsaError(f"DeepSpeed config {path}: \"{name}\" must be a JSON object, not {type(value).__name__} "
                            f"({json.dumps(value)[:40]}); fix the file or pass a shipped config with --deepspeed")
    check_values(raw, path)  # each value read before DeepSpeed checks it: its type and range
    for section in FILE_MONITORS:  # a job_name with a separator, "..", or an absolute one would put the logs outside output_path
        name = raw.get(section, {}).get("job_name", DEFAULT_JOB_NAME)
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise ElsaError(f"DeepSpeed config {path}: \"{section}.job_name\" must be one plain folder name (DeepSpeed writes "
                            f"the logs in output_path/job_name), not {json.dumps(name)[:60]}; name the folder with "
                            "output_path, or leave both out (the logs then go to OUTPUT_DIR/monitor)")
    for section, key in CODE_KEYS:
        if isinstance(raw.get(section), dict) and raw[section].get(key) is not None:
            raise ElsaError(f"DeepSpeed config {path}: \"{section}.{key}\" names Python modules for DeepSpeed to import, "
                            "and a config file is read as data, never as code; remove the key (DeepSpeed's own list "
                            "of module classes then applies)")


def _apply_nvme_path(zero: dict[str, Any], nvme_path: str | None) -> None:
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key, {})
        if section.get("device") == "nvme" and nvme_path is not None:
            section["nvme_path"] = nvme_path


def _nvme_problems(zero: dict[str, Any], nvme_path: str | None, check_paths: bool = True) -> list[str]:
    """Every NVMe path must be set (and exist and be writable), and the optimizer swapper needs enough buffers; an
    --nvme_path for a config that offloads nothing to NVMe is refused (a walk: it was dropped without a word, and the
    run held everything in host memory)."""
    found: list[str] = []
    if nvme_path is not None and all(zero.get(key, {}).get("device") != "nvme" for key in ("offload_param", "offload_optimizer")):
        found.append(f"--nvme_path {nvme_path} is given, but this DeepSpeed config offloads nothing to NVMe (its offload_param "
                     "and offload_optimizer devices are not nvme): use ds_configs/zero3_nvme.json (or set a section's "
                     "device to nvme), or drop --nvme_path")
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key, {})
        if section.get("device") != "nvme":
            continue
        path = nvme_path if nvme_path is not None else section.get("nvme_path")
        where = "--nvme_path" if nvme_path is not None else f"zero_optimization.{key}.nvme_path"
        if not path:
            problem = f"zero_optimization.{key}.device is nvme but no nvme_path is set; pass --nvme_path DIR"
        elif not check_paths:
            continue
        elif not Path(path).is_dir():
            fix = "create it" if nvme_path is not None else "create it or pass --nvme_path DIR"
            problem = f"NVMe path {path} ({where}) does not exist or is not a directory; {fix}"
        elif not os.access(path, os.W_OK | os.X_OK):
            problem = f"NVMe path {path} ({where}) is not writable; pass --nvme_path DIR on a writable local disk"
        elif why := direct_io_problem(Path(path)):
            problem = f"NVMe path {path} ({where}): {why}; pass --nvme_path DIR on a local disk (ext4, xfs)"
        else:
            continue
        if problem not in found:  # --nvme_path serves both sections: said once
            found.append(problem)
    opt = zero.get("offload_optimizer", {})
    if opt.get("device") == "nvme" and int(opt.get("buffer_count", 4)) < NVME_OPTIMIZER_BUFFERS:
        found.append(f"zero_optimization.offload_optimizer.buffer_count is {opt.get('buffer_count', 4)}; ELSA swaps "
                     f"{NVME_OPTIMIZER_BUFFERS} tensors per sub-group (master, exp_avg, exp_avg_sq, z, u, gradient): "
                     f"set it to at least {NVME_OPTIMIZER_BUFFERS}")
    return found
