"""Write a pruned model as an elsa-sparse checkpoint (values + positions per pruned weight), or check one:

    python launch/compress.py out/llama2-7b-90 out/llama2-7b-90-sparse
    python launch/compress.py --verify out/llama2-7b-90-sparse

Load it back with ``elsa_ds.sparse.from_pretrained(path, mode="dense" | "sparse")``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elsa_ds.sparse.cli import command  # noqa: E402

if __name__ == "__main__":
    command()
