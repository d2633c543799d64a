"""ELSA on every architecture in one launch (the tests' 2-rank run): ``deepspeed --num_gpus 2 run_elsa.py SPEC.json``.

SPEC: {"deepspeed": path, "dataset": path, "settings": {...}, "runs": {output_dir: model_dir}}. One process group
serves every job (the Python API runs jobs back to back), so the launcher's start-up is paid once.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import elsa_ds  # noqa: E402

if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[-1]).read_text())
    for out, model in spec["runs"].items():
        elsa_ds.prune(model, spec["dataset"], output_dir=out, deepspeed=spec["deepspeed"], overwrite=True, **spec["settings"])
