"""Size and decode speed of a sparse checkpoint: dense mode against sparse mode, side by side in one process.

Decode is timed as the model runs it in ``generate``: a prompt is prefilled once, then every step feeds one token
per sequence with the KV cache. The two modes alternate round by round (dense, sparse, dense, ...) so that a
neighbour's load on a shared machine falls on both; every round's ratio is kept, so the spread can be reported.
Beside each tokens/s figure stands its memory-bandwidth floor: tokens/s if the only cost were streaming the
weights each step reads once from memory (dense: 2 bytes per bf16 weight; sparse: its values, deltas and row
offsets) at the read bandwidth measured here (a STREAM-like sum over a buffer far larger than the caches).
"""
from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elsa_ds.errors import ElsaError
from elsa_ds.log import get_logger
from elsa_ds.sparse import format as fmt
from elsa_ds.sparse.compress import compress
from elsa_ds.sparse.folder import TensorReader, is_weight_file
from elsa_ds.sparse.linear import SparseLinear
from elsa_ds.sparse.loader import from_pretrained
from elsa_ds.sparse.meta import CONFIG_KEY, elsa_named, read_config, sparse_meta

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = get_logger(__name__)


def now(device: torch.device | str = "cpu") -> float:
    """A clock reading after the device's queued work is done (a CUDA timing must not stop at the launch)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes/s of a streaming read (torch.sum of an fp32 buffer of ``nbytes`` on ``device``), best of ``repeats``."""
    buf = torch.ones(nbytes // 4, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = now(device)
        buf.sum()
        best = min(best, now(device) - start)
    return nbytes / best


def streamed_bytes(module: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every Linear's weight (dense) or a SparseLinear's code."""
    total = 0
    for m in module.modules():
        if isinstance(m, SparseLinear):
            total += m.weight_bytes
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def disk_bytes(sparse_dir: Path) -> dict[str, int]:
    """Bytes on disk of the sparse weight files against the dense export's, whole model and pruned weights alone."""
    meta = sparse_meta(sparse_dir, verify=False)  # sizes only: from_pretrained checks the checksums
    reader = TensorReader(sparse_dir, elsa_named(meta))
    owners = {f"{n}.{p}": n for n, info in meta["tensors"].items() for p in fmt.PARTS[info["encoding"]]}
    pruned = sum(_numel_bytes(reader.get(name)) for name in owners if name in reader.names)
    plain = sum(_numel_bytes(reader.get(name)) for name in reader.names if name not in owners)
    pruned_dense = sum(_dense_bytes(info) for info in meta["tensors"].values())
    files = sum(f.stat().st_size for f in Path(sparse_dir).iterdir() if f.is_file() and is_weight_file(f))
    return {"pruned_dense": pruned_dense, "pruned_sparse": pruned, "model_dense": pruned_dense + plain,
            "model_sparse": pruned + plain, "sparse_files": files}


def _numel_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dense_bytes(info: dict) -> int:
    rows, cols = info["shape"]
    return rows * cols * torch.empty(0, dtype=getattr(torch, info["dtype"])).element_size()


@torch.no_grad()
def decode_seconds(model: PreTrainedModel, batch: int, steps: int, prompt: int = 16, seed: int = 0, layers_only: bool = False) -> float:
    """Seconds for ``steps`` decode steps of ``batch`` sequences after a ``prompt``-token prefill (not timed)."""
    gen = torch.Generator().manual_seed(seed)
    vocab, device = model.config.vocab_size, model.device
    ids = torch.randint(vocab, (batch, prompt), generator=gen).to(device)
    steps_ids = torch.randint(vocab, (steps, batch, 1), generator=gen).to(device)
    net = model.get_decoder() if layers_only else model
    cache = net(input_ids=ids, use_cache=True).cache
    start = now(device)
    for step in steps_ids:
        cache = net(input_ids=step, cache=cache, use_cache=True).cache
    return now(device) - start


def _relative(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


@torch.no_grad()
def logits_agreement(dense: PreTrainedModel, sparse: PreTrainedModel, batch: int = 2, prompt: int = 8, seed: int = 0) -> float:
    """max |sparse − dense| / max |dense| over the logits of a prefill and of the decode step after it."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(dense.config.vocab_size, (batch, prompt + 1), generator=gen).to(dense.device)
    a, b = dense(input_ids=ids[:, :prompt], use_cache=True), sparse(input_ids=ids[:, :prompt], use_cache=True)
    worst = _relative(a.logits, b.logits)
    a = dense(input_ids=ids[:, prompt:], cache=a.cache, use_cache=True)
    b = sparse(input_ids=ids[:, prompt:], cache=b.cache, use_cache=True)
    return max(worst, _relative(a.logits, b.logits))


def alternating(seconds: Callable[[str, int], float], rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """``seconds(mode, round)`` for both modes every round, dense first in even rounds and sparse first in odd ones
    (ABBA: a neighbour's load falls on both): each mode's median, and the per-round dense / sparse ratio's median and
    range (``ratio``, ``ratio_min``, ``ratio_max``, the keys of a row)."""
    times: dict[str, list[float]] = {"dense": [], "sparse": []}
    for r in range(rounds):
        for name in ("dense", "sparse") if r % 2 == 0 else ("sparse", "dense"):
            times[name].append(seconds(name, r))
    ratios = [d / s for d, s in zip(times["dense"], times["sparse"])]
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return medians, {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def compare_decode(dense: PreTrainedModel, sparse: PreTrainedModel, batch: int, steps: int, rounds: int, prompt: int,
                   bandwidth: float, layers_only: bool = False) -> dict:
    """Decode tokens/s of both models, alternating (ABBA), with each one's byte floor and every round's ratio."""
    models = {"dense": dense, "sparse": sparse}
    median, ratio = alternating(lambda name, r: decode_seconds(models[name], batch, steps, prompt, seed=r, layers_only=layers_only),
                                rounds)
    row: dict = {"batch": batch, "steps": steps, "rounds": rounds, **ratio}
    for name, model in models.items():
        streamed = streamed_bytes(model.get_decoder() if layers_only else model)
        row[name] = {"tokens_per_s": batch * steps / median[name], "bytes_per_step": streamed,
                     "floor_tokens_per_s": batch * bandwidth / streamed}
    return row


def measure(sparse_dir: str | Path, batches: tuple[int, ...] = (1, 8), steps: int = 8, rounds: int = 3, prompt: int = 16,
            layers_only: bool = False, bandwidth: float | None = None) -> dict:
    """Bytes on disk, logits agreement and decode tokens/s (dense mode against sparse mode) of a sparse checkpoint.

    ``layers_only`` times the decoder stack without the LM head (a few layers at a big model's shapes stand in for
    the whole stack, where the head's share is small); ``bandwidth`` in bytes/s, measured here when None.
    """
    sparse_dir = Path(sparse_dir)
    dense, sparse = from_pretrained(sparse_dir, "dense"), from_pretrained(sparse_dir, "sparse")
    bandwidth = bandwidth or read_bandwidth()
    result: dict[str, Any] = {"disk": disk_bytes(sparse_dir), "read_bandwidth_gb_s": bandwidth / 1e9, "layers_only": layers_only,
              "logits_max_rel_err": logits_agreement(dense, sparse), "threads": torch.get_num_threads(), "decode": []}
    for batch in batches:
        result["decode"].append(compare_decode(dense, sparse, batch, steps, rounds, prompt, bandwidth, layers_only))
    return result


@torch.no_grad()
def generate_tokens(model: PreTrainedModel, batch: int, steps: int, prompt: int, seed: int = 0) -> tuple[float, torch.Tensor]:
    """One ``generate()`` as a user calls it: ``batch`` random prompts of ``prompt`` tokens, ``steps`` new tokens (greedy,
    no early stop). On CUDA with a static cache, which transformers compiles into a CUDA graph (a sparse model loaded on
    CUDA has it by default; a dense one is given it here, so both run compiled). Seconds, prefill included, and the
    new tokens."""
    ids = torch.randint(model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(seed)).to(model.device)
    static = {"cache_implementation": "static"} if model.device.type == "cuda" else {}
    start = now(model.device)
    generate: Any = model.generate  # GenerationMixin's; the stubs of PreTrainedModel's __getattr__ say Tensor
    out = generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps, do_sample=False, **static)
    return now(model.device) - start, out[:, prompt:]


def compare_generate(dense: PreTrainedModel, sparse: PreTrainedModel, batch: int, steps: int, rounds: int, prompt: int) -> dict:
    """generate() tokens/s of both models alternating (ABBA) after one untimed call each (on CUDA: the compile; its
    seconds are ``first_call_s``), whether the sparse model's greedy tokens were the dense model's in every round
    (``same_tokens``), and the fraction of them that were (``equal_token_fraction``)."""
    models = {"dense": dense, "sparse": sparse}
    first = {name: generate_tokens(model, batch, steps, prompt, seed=rounds)[0] for name, model in models.items()}
    tokens: dict[tuple[str, int], torch.Tensor] = {}

    def seconds(name: str, r: int) -> float:
        took, tokens[name, r] = generate_tokens(models[name], batch, steps, prompt, seed=r)
        return took

    median, ratio = alternating(seconds, rounds)
    same = all(torch.equal(tokens["dense", r], tokens["sparse", r]) for r in range(rounds))
    equal = sum(int((tokens["dense", r] == tokens["sparse", r]).sum()) for r in range(rounds)) / (rounds * batch * steps)
    row: dict = {"batch": batch, "steps": steps, "prompt": prompt, "rounds": rounds, **ratio, "same_tokens": same,
                 "equal_token_fraction": equal}
    for name in models:
        row[name] = {"tokens_per_s": batch * steps / median[name], "first_call_s": first[name]}
    return row


def rss_bytes() -> int | None:
    """This process's resident set size (Linux /proc/self/statm), None where it cannot be read."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, a tensor shared by two modules (tied weights) counted once."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


def load_measured(sparse_dir: Path, mode: str, device: str = "cpu") -> tuple[PreTrainedModel, dict]:
    """from_pretrained in ``mode`` on ``device``, with the growth over the load of the process's RSS (on CUDA: of the
    GPU memory torch has allocated) and the model's tensor bytes."""
    gc.collect()
    cuda = torch.device(device).type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else rss_bytes()
    model = from_pretrained(sparse_dir, mode, device=device)
    after = torch.cuda.memory_allocated(device) if cuda else rss_bytes()
    delta = None if before is None or after is None else after - before
    return model, {"gpu_allocated_delta_bytes" if cuda else "rss_delta_bytes": delta, "tensor_bytes": tensor_bytes(model)}


@torch.no_grad()
def prefill_seconds(model: PreTrainedModel, batch: int, prompt: int, seed: int = 0) -> float:
    """Seconds for one forward of ``batch`` random prompts of ``prompt`` tokens (KV cache built, as generate does)."""
    ids = torch.randint(model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(seed)).to(model.device)
    start = now(model.device)
    model(input_ids=ids, use_cache=True)
    return now(model.device) - start


def compare_prefill(dense: PreTrainedModel, sparse: PreTrainedModel, batch: int, prompt: int, rounds: int, bandwidth: float) -> dict:
    """Prefill tokens/s of both models alternating (ABBA); the floor: one pass over the weights per forward."""
    models = {"dense": dense, "sparse": sparse}
    median, ratio = alternating(lambda name, r: prefill_seconds(models[name], batch, prompt, seed=r), rounds)
    row: dict = {"batch": batch, "prompt": prompt, "rounds": rounds, **ratio}
    for name, model in models.items():
        streamed = streamed_bytes(model)
        row[name] = {"tokens_per_s": batch * prompt / median[name], "bytes_per_step": streamed,
                     "floor_tokens_per_s": batch * prompt * bandwidth / streamed}
    return row


def speed_report(model_dir: str | Path, batches: tuple[int, ...] = (1, 8), prompt: int = 128, steps: int = 8,
                 rounds: int = 3, bandwidth: float | None = None, device: str = "cpu") -> dict:
    """Size, memory, prefill and decode speed, and logits agreement of a model's dense and sparse modes, side by side.

    ``model_dir``: an elsa-sparse checkpoint, or a dense pruned Hugging Face folder, compressed first into a temporary
    checkpoint (ElsaError when it has no pruned weight). Memory is given two ways: the process's RSS growth over each
    load (dense loaded first; on CUDA the growth of the GPU memory torch allocated) and the bytes of the model's tensors.
    ``bandwidth`` in bytes/s, measured on ``device`` when None. Beside prefill and decode, ``generate()`` end to end.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ElsaError(f"{path}: not a folder; the speed comparison needs a local sparse checkpoint or dense pruned model folder")
    if CONFIG_KEY in read_config(path):
        sparse_meta(path)  # an unknown version, a broken block or an edited config: one line before anything is loaded
        return _report(path, path, batches, prompt, steps, rounds, bandwidth, device)
    with tempfile.TemporaryDirectory(prefix="elsa_speed_") as tmp:
        log.info(f"{path} is a dense folder: compressing it into a temporary elsa-sparse checkpoint")
        compress(path, Path(tmp) / "sparse")
        return _report(path, Path(tmp) / "sparse", batches, prompt, steps, rounds, bandwidth, device)


def _warm_up(sparse_dir: Path) -> None:
    """Build the model once on the meta device (no memory), so the modeling code's imports do not count in the first
    load's RSS growth, and build or load the decode kernel for the same reason."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from elsa_ds.sparse import kernels

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sparse_dir, trust_remote_code=False), trust_remote_code=False)
    kernels.load()


def _report(path: Path, sparse_dir: Path, batches: tuple[int, ...], prompt: int, steps: int, rounds: int,
            bandwidth: float | None, device: str) -> dict:
    _warm_up(sparse_dir)
    dense, dense_memory = load_measured(sparse_dir, "dense", device)
    sparse, sparse_memory = load_measured(sparse_dir, "sparse", device)
    bandwidth = bandwidth or read_bandwidth(device=device)
    meta = sparse_meta(sparse_dir, verify=False)  # the loads above checked it
    dtypes = sorted({info["dtype"] for info in meta["tensors"].values()})
    result = {"model": str(path), "device": str(dense.device), "compressed_here": sparse_dir != path,
              "pruned_weights": len(meta["tensors"]), "pruned_dtype": ",".join(dtypes), "disk": disk_bytes(sparse_dir),
              "memory": {"dense": dense_memory, "sparse": sparse_memory}, "read_bandwidth_gb_s": bandwidth / 1e9,
              "threads": torch.get_num_threads(), "logits_max_rel_err": logits_agreement(dense, sparse),
              "prefill": [compare_prefill(dense, sparse, b, prompt, rounds, bandwidth) for b in batches],
              "decode": [compare_decode(dense, sparse, b, steps, rounds, prompt, bandwidth) for b in batches],
              "generate": [compare_generate(dense, sparse, b, steps, rounds, prompt) for b in batches]}
    return result


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:.1f} MB"


def speed_table(r: dict) -> str:
    """Markdown: bytes and memory, then prefill and decode tokens/s of both modes with their byte floors."""
    disk, mem = r["disk"], r["memory"]
    lines = [f"Dense vs sparse mode of {r['model']} ({r['pruned_weights']} pruned weights, {r['pruned_dtype']}; "
             f"{r['device']}, {r['threads']} threads; read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s; logits max rel. err "
             f"{r['logits_max_rel_err']:.1e})", "",
             "| measure | dense | sparse | sparse / dense |", "|---|---|---|---|"]
    # stored tensor bytes (a dense export's against these files'), not file sizes: the files' headers and checksums
    # are on their own row (an audit, 2026-12-07: "disk" rows 0.522x where the files were 0.523x)
    for label, d, s in (("stored tensor bytes, pruned weights", disk["pruned_dense"], disk["pruned_sparse"]),
                        ("stored tensor bytes, whole model", disk["model_dense"], disk["model_sparse"]),
                        ("weight files on disk (headers included)", None, disk.get("sparse_files")),
                        ("memory, tensor bytes", mem["dense"]["tensor_bytes"], mem["sparse"]["tensor_bytes"]),
                        (_growth_label(mem), *(next(v for k, v in mem[m].items() if k.endswith("delta_bytes"))
                                               for m in ("dense", "sparse")))):
        ratio = f"{s / d:.3f}x" if d and s is not None else "n/a"
        lines.append(f"| {label} | {_mb(d)} | {_mb(s)} | {ratio} |")
    # tok/s: each mode's median round; the ratio: the median of each round's paired ratio (ABBA), which a neighbour's load
    # disturbs less, so the two can disagree on a busy machine; the byte floor: the tok/s that reading the bytes allows
    lines += ["", "| phase | batch | dense tok/s (at the byte floor) | sparse tok/s (at the byte floor) | sparse / dense, "
              "median of the rounds' pairs (min-max) | bytes read per step dense / sparse |", "|---|---|---|---|---|---|"]
    for phase in ("prefill", "decode"):
        for row in r[phase]:
            what = f"{phase} ({row['prompt']} tokens)" if phase == "prefill" else f"decode ({row['steps']} steps)"
            lines.append(f"| {what} | {row['batch']} | {row['dense']['tokens_per_s']:.2f} ({row['dense']['floor_tokens_per_s']:.1f}) | "
                         f"{row['sparse']['tokens_per_s']:.2f} ({row['sparse']['floor_tokens_per_s']:.1f}) | "
                         f"{row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) | "
                         f"{_mb(row['dense']['bytes_per_step'])} / {_mb(row['sparse']['bytes_per_step'])} |")
    lines += ["", "| generate() end to end | batch | dense tok/s | sparse tok/s | sparse / dense, median of the rounds' pairs "
              "(min-max) | greedy tokens equal |", "|---|---|---|---|---|---|"]
    for row in r["generate"]:
        lines.append(f"| {row['steps']} new tokens after {row['prompt']} | {row['batch']} | {row['dense']['tokens_per_s']:.2f} | "
                     f"{row['sparse']['tokens_per_s']:.2f} | {row['ratio']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f}) | "
                     f"{'yes' if row['same_tokens'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _growth_label(memory: dict) -> str:
    return "memory, GPU allocated at load" if "gpu_allocated_delta_bytes" in memory["dense"] else "memory, RSS growth at load"
