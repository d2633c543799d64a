"""Build one of the benchmark models (corpus + tokenizer + training + held-out perplexity), deterministically.

    python bench/models/build.py --name docs-llama          # Llama, 12.6M params, kernel docs: ~35 min on 2 idle cores
    python bench/models/build.py --name check-qwen2         # Qwen2, 6.8M params, man-pages: ~15 min idle, ~50 min crowded
    python bench/models/build.py --name docs-llama --out DIR --corpus_dir DIR

The model goes to ``--out`` (default ``~/.cache/elsa_ds/models/<name>``), its corpus to ``--corpus_dir``
(default ``~/.cache/elsa_ds/corpora/<corpus>``). An existing complete build with the same recipe and
corpus is reused; anything else there (a partial or stale build) is rebuilt. Training writes to
``<out>.tmp``, which is renamed to ``<out>`` only once weights, tokenizer, ``training_metrics.json``
and ``README.md`` are all written. Same packages, seed and library versions give the same weights.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.models.corpora import CorpusError, build_corpus  # noqa: E402
from bench.models.train_model import TrainSettings, train  # noqa: E402

MODELS_HOME = Path("~/.cache/elsa_ds/models")
CORPORA_HOME = Path("~/.cache/elsa_ds/corpora")
TOKENIZER_PIPELINE = "as-loaded"  # BPE trained under the pre-tokenization AutoTokenizer imposes (train_model.make_tokenizer)

class Recipe(NamedTuple):
    corpus: str
    settings: TrainSettings
    role: str  # one line, for the model card and models.json
    prune: float  # fraction of the corpus's documents in its prune split (never trained on); 0: no such split


RECIPES: dict[str, Recipe] = {
    "docs-llama": Recipe("linux-doc", TrainSettings(
        arch="llama", arch_kwargs={"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
                                   "num_attention_heads": 6, "num_key_value_heads": 2},
        vocab=8192, add_bos=True, seqlen=256, batch=16, steps=840, lr=2e-3, warmup=0.05, final_lr_ratio=0.1,
        eval_every=100, eval_blocks=64, seed=0, threads=2),
        "the second quality-benchmark model: Llama architecture on the Linux kernel documentation", 0.25),
    "check-qwen2": Recipe("manpages", TrainSettings(
        arch="qwen2", arch_kwargs={"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
                                   "num_attention_heads": 4, "num_key_value_heads": 2},
        vocab=8192, add_bos=False, seqlen=256, batch=16, steps=400, lr=3e-3, warmup=0.05, final_lr_ratio=0.1,
        eval_every=100, eval_blocks=64, seed=0, threads=1),
        "the check model: a different architecture (Qwen2) on a different corpus (man-pages), tuned on by nobody", 0.0),
}


def recipe_key(corpus_meta: dict, settings: TrainSettings) -> str:
    """Hash of everything that determines the weights we control: the recipe and the exact corpus files."""
    corpus = {s: corpus_meta["splits"][s]["sha256"] for s in corpus_meta["splits"]}
    ident = {"tokenizer": TOKENIZER_PIPELINE, "settings": asdict(settings), "corpus": corpus}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def is_complete(out: Path, key: str) -> bool:
    try:
        metrics = json.loads((out / "training_metrics.json").read_text())
    except (OSError, ValueError):
        return False
    return (metrics.get("recipe_key") == key and (out / "model.safetensors").is_file()
            and (out / "tokenizer.json").is_file() and (out / "README.md").is_file())


def model_readme(name: str, role: str, corpus_name: str, corpus_meta: dict, m: dict) -> str:
    """The model card, from the metrics (like elsa_ds/demo/README.md)."""
    s = m["settings"]
    pkgs = ", ".join(f"`{p}` {v}" for p, v in corpus_meta["packages"].items())
    docs = {k: v["documents"] for k, v in corpus_meta["splits"].items()}
    curve = "\n".join(f"| {c['step']} | {c['tokens']:,} | {c['train_loss']:.3f} | {c['val_probe_ppl']:.2f} |"
                      for c in m["val_curve"])
    bos = ("A `TemplateProcessing` post-processor prepends `<bos>` to every encoded text (`tokenizer(text)` "
           "starts with id 2), like Llama's tokenizer" if s["add_bos"] else
           "There is no post-processor: `tokenizer(text)` adds no special token")
    arch = json.dumps(s["arch_kwargs"])
    prune_line = (f"\n- **Prune split**: {docs['prune']} more documents that neither the tokenizer nor the model trains on: the "
                  f"text `bench/quality.py` prunes, calibrates and retrains on (`prune.jsonl`), as a large model pruned on "
                  f"fresh C4 crops has never memorised them." if "prune" in docs else "")
    return f"""# {name}

{role[0].upper() + role[1:]}. Built by

```
python bench/models/build.py --name {name}
```

on 2 shared CPU cores (torch {m['versions']['torch']}, transformers {m['versions']['transformers']}) in
{m['wall_s']:.0f} s ({m['train_wall_s']:.0f} s of training, {m['eval_wall_s']:.0f} s of final evaluation).

- **Corpus** `{corpus_name}`: {corpus_meta['description']}, from {pkgs}. One document per source file,
  split by whole document with seed {corpus_meta['seed']}: {docs['train']} train, {docs['validation']} validation,
  {docs['test']} test documents ({m['tokens']['train']:,} / {m['tokens']['validation']:,} / {m['tokens']['test']:,}
  tokens in 256-token blocks).{prune_line}
- **Tokenizer**: byte-level BPE, {m['tokenizer']['vocab_size']} tokens, trained on the train split only.
  `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3. {bos}. `elsa_ds.data.pack_blocks` encodes with
  `add_special_tokens=False` and puts one BOS at the start of every block, an EOS between documents.
- **Model**: `{m['arch']}`, {m['n_params']:,} parameters (tied embedding counted once), `{arch}`,
  vocab {m['tokenizer']['vocab_size']}, tied embeddings, fp32 safetensors.
- **Training**: AdamW (0.9, 0.95), weight decay {s['weight_decay']} on matrices only, peak lr {s['lr']} after
  {m['warmup_steps']} warm-up steps, cosine to {s['final_lr_ratio']}x, gradient clipping {s['clip']}, bf16
  autocast forward/backward (fp32 weights and optimizer), {s['steps']} steps x {s['batch']} blocks x {s['seqlen']}
  tokens = {m['tokens_seen']:,} tokens ({m['epochs']} epochs), seeded block order (seed {s['seed']}).

Final metrics (`training_metrics.json`; perplexity by `launch/evaluate.py`'s code on the saved model, fp32,
every 256-token window of the split file):

| steps | tokens seen | train loss (last 50 steps) | validation ppl | test ppl | params |
| --- | --- | --- | --- | --- | --- |
| {m['steps']} | {m['tokens_seen']:,} | {m['final_train_loss']:.3f} | {m['val_ppl']:.2f} | {m['test_ppl']:.2f} | {m['n_params']:,} |

Training curve (validation probe: {s['eval_blocks']} fixed validation blocks, bf16 off):

| step | tokens | train loss (window mean) | val probe ppl |
| --- | --- | --- | --- |
{curve}
"""


def build(name: str, out: Path | None = None, corpus_dir: Path | None = None, log=print) -> Path:
    """Build (or reuse) model ``name``; returns its directory."""
    corpus_name, settings, role, prune = RECIPES[name]
    out = (out or MODELS_HOME / name).expanduser()
    corpus_dir = (corpus_dir or CORPORA_HOME / corpus_name).expanduser()
    corpus_meta = build_corpus(corpus_name, corpus_dir, prune=prune)
    key = recipe_key(corpus_meta, settings)
    if is_complete(out, key):
        log(f"{out}: complete build of {name} (recipe {key}); reusing it")
        return out
    log(f"building {name} -> {out} (recipe {key}; corpus {corpus_dir})")
    log("settings: " + json.dumps(asdict(settings)))
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    metrics = train(settings, corpus_dir, tmp, log=log)
    metrics = {"name": name, "recipe_key": key, "corpus": {"name": corpus_name, "dir": str(corpus_dir),
               "packages": corpus_meta["packages"], "documents": {k: v["documents"] for k, v in corpus_meta["splits"].items()}},
               **metrics}
    (tmp / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (tmp / "README.md").write_text(model_readme(name, role, corpus_name, corpus_meta, metrics))
    if out.exists():
        shutil.rmtree(out)  # partial or stale
    tmp.rename(out)
    log(f"saved {out}: val ppl {metrics['val_ppl']}, test ppl {metrics['test_ppl']}, {metrics['wall_s']} s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", choices=sorted(RECIPES), required=True)
    ap.add_argument("--out", type=Path, help="model directory [~/.cache/elsa_ds/models/NAME]")
    ap.add_argument("--corpus_dir", type=Path, help="corpus directory [~/.cache/elsa_ds/corpora/CORPUS]")
    args = ap.parse_args(argv)
    try:
        build(args.name, args.out, args.corpus_dir, log=lambda m: print(m, flush=True))
    except CorpusError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
