"""--resume_if_any over a finished run: nothing to do when it ran with this job's settings, else one refusal.

A scheduler's requeue loop runs the same command line until it succeeds; a run that has finished is its success, so
the loop's next attempt ends at once with exit code 0 and leaves the output as it is. Settings that differ mean another
job, which the finished output does not answer: refused, as a fresh start over it would be.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elsa_ds import json_data
from elsa_ds.data.sources import source_name
from elsa_ds.errors import ElsaError
from elsa_ds.files.output import REPORT_NAME, check_output_path
from elsa_ds.plan import planned_settings
from elsa_ds.plan.checks import model_source
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.options import JobOptions

SHOWN = 6  # the differences a refusal names


def finished_run(cfg: ElsaConfig, opts: JobOptions) -> tuple[dict[str, Any], ElsaConfig]:
    """The report of the finished run in ``opts.output_dir`` and the settings this job would run (the defaults rule
    applied), when that run had them, the same ranks and the same export format; ElsaError naming what differs
    otherwise. A value the defaults rule filled in for both is the same command's (an upgrade may have changed the rule,
    a resumed attempt kept its checkpoint's); a setting newer than the report is compared with its default."""
    out = Path(opts.output_dir).expanduser()
    check_output_path(out)  # named by its own path, whatever the flags: a link's target is not this job's output
    report = read_report(out / REPORT_NAME)
    planned, defaults, world = planned_settings(cfg, opts, model_source(cfg, opts))
    now = {"world_size": world, "export_format": opts.export_format, **_plain(planned.model_dump(mode="json"))}
    config = report.get("config")
    if not isinstance(config, dict):
        raise ElsaError(f"--resume_if_any: {out / REPORT_NAME} records no settings to compare with this job's; --overwrite in "
                        "place of --resume_if_any replaces the finished run, or choose another --output_dir")
    then = {"world_size": report.get("world_size"), "export_format": "sparse" if "export" in report else "dense",
            **{k: v for k, v in _field_defaults().items() if k not in config}, **config}
    for settings in (then, now):  # documents given in memory by their content (the report's way), not a passing file
        if isinstance(settings.get("dataset"), str):
            settings["dataset"] = source_name(settings["dataset"])
    ruled = set(_applied(report.get("defaults"))) & set(_applied(defaults))
    if changed := [k for k in {**then, **now} if k not in ruled and not json_data.same(then.get(k), now.get(k))]:
        shown = ", ".join(f"{k} {_short(then.get(k))} vs {_short(now.get(k))}" for k in changed[:SHOWN])
        more = f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
        raise ElsaError(f"--resume_if_any: {out} holds a finished run with other settings (that run vs this one: {shown}{more}); "
                        "--overwrite in place of --resume_if_any replaces it, or choose another --output_dir")
    return report, planned


def _applied(defaults: Any) -> dict[str, Any]:
    """The fields a defaults record (``apply_defaults``' second value, kept in a report) says the rule filled in."""
    applied = defaults.get("applied") if isinstance(defaults, dict) else None
    return applied if isinstance(applied, dict) else {}


def _field_defaults() -> dict[str, Any]:
    """Every ELSA setting's default, as a report holds it."""
    return _plain(ElsaConfig.model_construct().model_dump(mode="json"))


def read_report(path: Path) -> dict[str, Any]:
    """A finished run's report as JSON data (a link or anything but a small JSON object refused: it is not one we wrote)."""
    if path.is_symlink() or not path.is_file():
        raise ElsaError(f"--resume_if_any: {path} is not a plain file, which no job writes; remove it or choose another --output_dir")
    try:
        report = json_data.read(path)
    except (OSError, ValueError) as err:
        raise ElsaError(f"--resume_if_any: {path} cannot be read ({err}); --overwrite in place of --resume_if_any "
                        "replaces the run, or choose another --output_dir") from None
    if not isinstance(report, dict):
        raise ElsaError(f"--resume_if_any: {path} is not a job's report (a JSON object); --overwrite in place of "
                        "--resume_if_any replaces the run, or choose another --output_dir")
    return report


def _plain(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings as the report holds them once read back (JSON's lists for tuples)."""
    return json.loads(json.dumps(settings))


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 48 else text[:45] + "..."
