"""Evaluate a (pruned) causal LM: sparsity report, perplexity and zero-shot accuracy, one JSON per model.

The published protocols (seqlen 2048, WikiText-2 test and 256 C4 windows, the seven lm-eval tasks 0-shot); perplexity
windows as SparseGPT/Wanda cut them (--ppl_protocol stream) or, for Gemma, as the ELSA authors do (window: BOS overwrites
each window's first token); the default auto picks per model family:

    python launch/evaluate.py --model out/gemma2-27b-70 --ppl wikitext2,c4 --tasks paper \\
        --output results/gemma2-27b-70.json --markdown results/gemma2-27b-70.md
    python launch/evaluate.py --model google/gemma-2-27b --ppl wikitext2,c4 --tasks --device_map auto \\
        --output results/gemma2-27b-dense.json       # too large for one GPU: spread over GPUs, CPU, disk

Offline, on local text and local task YAMLs (a quick check: at most 20 windows and 20 examples per task):

    python launch/evaluate.py --model out/demo --ppl path/to/text.txt --seqlen 256 \\
        --tasks my_task --include_path path/to/task_yamls --limit 20 --output out/demo_eval.json

Size, memory, prefill and decode speed of a pruned model's dense and sparse modes, side by side on the GPU when there is
one, else the CPU (an elsa-sparse checkpoint, or a dense pruned folder, compressed to a temporary checkpoint first):

    python launch/evaluate.py --model out/llama2-7b-90-sparse --speed --output results/llama2-7b-90-speed.json

One table from several results (printed, and written with --markdown):

    python launch/evaluate.py --compare results/gemma2-27b-dense.json results/gemma2-27b-70.json --markdown results/table.md
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elsa_ds.cli import evaluate_command  # noqa: E402

if __name__ == "__main__":
    evaluate_command()
