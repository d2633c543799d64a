"""Run by test_export.py in a process of its own: export ZeRO-3 models of two depths, measuring the growth of peak RSS.

    python tests/zero/export_probe.py OUT_DIR LAYERS [LAYERS ...]

Prints one JSON line: per depth the 16-bit state bytes, the largest tensor's bytes and the peak RSS growth during
``export_model`` (peak reset through /proc/self/clear_refs, read from VmHWM), and whether the first export loads with
``from_pretrained`` into exactly the gathered weights.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from elsa_ds.models import ModelSource  # noqa: E402
from elsa_ds.zero.dist import init_distributed, teardown  # noqa: E402
from elsa_ds.zero.ds_config import DsConfig  # noqa: E402
from elsa_ds.zero.engine import load_partitioned  # noqa: E402
from elsa_ds.zero.export import export_model  # noqa: E402

DS = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def status_kib(key: str) -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1])


class NoTokenizer:
    def save_pretrained(self, path) -> None:
        pass


def model_dir(root: Path, layers: int) -> Path:
    from transformers import Gemma2Config

    d = root / f"config{layers}"
    Gemma2Config(vocab_size=512, hidden_size=256, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, max_position_embeddings=256, sliding_window=64).save_pretrained(d)
    return d


def main() -> None:
    root, depths = Path(sys.argv[1]), [int(x) for x in sys.argv[2:]]
    rank, _ = init_distributed()
    result = {}
    first = None
    for layers in depths:
        built = load_partitioned(ModelSource(str(model_dir(root, layers))), DsConfig(DS), random_init=True)
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = status_kib("VmRSS")
        largest = export_model(built.model, NoTokenizer(), root / f"export{layers}", rank)
        growth = (status_kib("VmHWM") - before) * 1024
        state = sum(2 * p.ds_numel for p in built.model.parameters())
        result[layers] = {"state_bytes": state, "largest_bytes": largest, "rss_growth": growth}
        first = first or (layers, built)
    layers, built = first
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(built.model.parameters())):
        gathered = {k: v.data.clone() for k, v in built.model.named_parameters()}
    built.hf_ds_config = None  # from_pretrained must build an ordinary model, not ZeRO-3 partitions
    gc.collect()
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(root / f"export{layers}", dtype=torch.bfloat16)
    params = dict(loaded.named_parameters())
    result["loads_exactly"] = params.keys() == gathered.keys() and all(torch.equal(params[k], v) for k, v in gathered.items())
    result["tied"] = loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    teardown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
