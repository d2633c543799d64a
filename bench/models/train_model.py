"""Train a small causal LM from scratch on one corpus directory (train/validation/test .jsonl).

    python bench/models/train_model.py --corpus ~/.cache/elsa_ds/corpora/linux-doc --arch llama \\
        --out /tmp/llama-test --steps 20 --eval_every 10      # a smoke run; build.py holds the real recipes

The recipe of the demo model (``elsa_ds/demo/train_demo.py``), generalised: a byte-level BPE tokenizer
trained on the train split only (specials <pad>=0, <eos>=1, <bos>=2, <unk>=3; with ``add_bos`` a
``TemplateProcessing`` post-processor prepends <bos> to every encoded text, as Llama's tokenizer does);
blocks packed exactly as the pruning job packs them (``elsa_ds.data.pack_blocks``: BOS first in every
block, EOS between documents, ``add_special_tokens=False``); AdamW (0.9, 0.95), decay on matrices only,
linear warm-up then cosine, gradient clipping at 1.0, bf16 autocast for forward/backward with fp32
weights and optimizer; a seeded block order (``elsa_ds.data.GlobalBatches``).

During training a fixed subset of validation blocks is scored every ``eval_every`` steps (the curve
goes into ``training_metrics.json``). At the end the model is saved (fp32 safetensors + tokenizer) and
its validation and test perplexities are measured on the *saved* model by ``elsa_ds.jobs.evaluate``,
the code behind ``launch/evaluate.py --ppl <dir>/validation.jsonl --seqlen 256``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tempfile

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.models.corpora import read_split  # noqa: E402
from elsa_ds.data import GlobalBatches, pack_blocks  # noqa: E402
from elsa_ds.demo.train_demo import SPECIALS, cosine_lr  # noqa: E402
from elsa_ds.evaluation.perplexity import ppl, window_nll  # noqa: E402


@dataclass
class TrainSettings:
    """Everything that determines the trained weights (given the corpus and the library versions)."""

    arch: str  # key of ARCHITECTURES
    arch_kwargs: dict = field(default_factory=dict)
    vocab: int = 8192
    add_bos: bool = False  # tokenizer post-processor prepends <bos> (Llama style)
    seqlen: int = 256
    batch: int = 16
    steps: int = 1000
    lr: float = 3e-3
    warmup: float = 0.05
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    precision: str = "bf16-mixed"
    eval_every: int = 100
    eval_blocks: int = 64
    threads: int = 2


def llama_config(vocab_size: int, **kw) -> PretrainedConfig:
    from transformers import LlamaConfig

    base = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5)
    return LlamaConfig(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                       tie_word_embeddings=True, **{**base, **kw})


def qwen2_config(vocab_size: int, **kw) -> PretrainedConfig:
    from transformers import Qwen2Config

    base = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                use_sliding_window=False)
    return Qwen2Config(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                       tie_word_embeddings=True, **{**base, **kw})


ARCHITECTURES = {"llama": llama_config, "qwen2": qwen2_config}


def train_bpe(texts: list[str], vocab: int, normalizer=None, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    """Byte-level BPE (the demo's: GPT-2 style byte alphabet, Gemma's special ids) under a given pre-tokenization."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    for want, token in enumerate(SPECIALS):
        assert tok.token_to_id(token) == want, (token, tok.token_to_id(token))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def as_loaded(tokenizer: PreTrainedTokenizerFast, config: PretrainedConfig):
    """The tokenizer as ``AutoTokenizer.from_pretrained`` returns it next to this model's config.

    transformers 5 rebuilds the pre-tokenization of some model types on load (a Qwen2 checkpoint gets
    ``Qwen2Tokenizer``: NFC + Qwen's split regex, whatever tokenizer.json says), so the tokenizer elsa_ds
    will use is not always the one that was trained.
    """
    with tempfile.TemporaryDirectory(prefix="elsa_tok_") as tmp:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def pipeline(tokenizer) -> tuple[str, str]:
    backend = tokenizer.backend_tokenizer
    return (json.dumps(json.loads(backend.to_str())["normalizer"]), json.dumps(json.loads(backend.to_str())["pre_tokenizer"]))


def make_tokenizer(texts: list[str], vocab: int, add_bos: bool, config: PretrainedConfig):
    """BPE on the train split, trained under the pre-tokenization the model type gets on load; returns it as loaded.

    With ``add_bos`` every ``tokenizer(text)`` starts with <bos> (a TemplateProcessing post-processor, Llama's behaviour).
    """
    def fit(normalizer=None, pre_tokenizer=None):
        tokenizer = train_bpe(texts, vocab, normalizer, pre_tokenizer)
        if add_bos:
            tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tokenizer.bos_token_id)])
        return tokenizer

    trained = fit()
    loaded = as_loaded(trained, config)
    if pipeline(loaded) != pipeline(trained):  # retrain the merges under the pipeline the loader imposes
        backend = loaded.backend_tokenizer
        trained = fit(backend.normalizer, backend.pre_tokenizer)
        loaded = as_loaded(trained, config)
        assert pipeline(loaded) == pipeline(trained), "the loader's pre-tokenization is not stable"
    return loaded


def blocks(tokenizer, texts: list[str], seqlen: int) -> torch.Tensor:
    """Pack documents like the pruning job: no post-processor tokens, BOS per block, EOS between documents."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return pack_blocks(ids, seqlen, tokenizer.bos_token_id, tokenizer.eos_token_id)


def heldout_ppl(model_dir: Path, corpus: Path, seqlen: int) -> dict[str, dict]:
    """Validation and test perplexity of the saved model by launch/evaluate.py's code (fp32, CPU)."""
    from elsa_ds.jobs.evaluate import EvalSettings, run

    result = run(EvalSettings(model=str(model_dir), ppl=[str(corpus / "validation.jsonl"), str(corpus / "test.jsonl")],
                              seqlen=seqlen, batch_size=8, dtype="fp32"))
    by_split = {}
    for source, r in result["ppl"].items():
        by_split[Path(source).stem] = {"ppl": round(r["ppl"], 3), "windows": r["windows"], "tokens": r["tokens"]}
    return by_split


def train(s: TrainSettings, corpus: Path, out: Path, log=print) -> dict:
    """Train per ``s`` on ``corpus``, save to ``out`` (which must not exist) and return the metrics."""
    torch.set_num_threads(s.threads)
    started = time.time()
    train_texts, val_texts, test_texts = (read_split(corpus, split) for split in ("train", "validation", "test"))
    tokenizer = make_tokenizer(train_texts, s.vocab, s.add_bos, ARCHITECTURES[s.arch](s.vocab, **s.arch_kwargs))
    train_blocks = blocks(tokenizer, train_texts, s.seqlen)
    val_blocks = blocks(tokenizer, val_texts, s.seqlen)
    test_blocks = blocks(tokenizer, test_texts, s.seqlen)
    del train_texts
    batches = GlobalBatches(train_blocks, s.batch, s.batch, world_size=1, rank=0, seed=s.seed)
    probe = val_blocks[torch.randperm(val_blocks.shape[0], generator=torch.Generator().manual_seed(s.seed))[:s.eval_blocks]]
    log(f"tokenizer {len(tokenizer)} tokens (add_bos={s.add_bos}); blocks train {tuple(train_blocks.shape)} "
        f"val {tuple(val_blocks.shape)} test {tuple(test_blocks.shape)}; {time.time() - started:.0f}s")

    config = ARCHITECTURES[s.arch](len(tokenizer), **s.arch_kwargs)
    torch.manual_seed(s.seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]  # norm scales and biases: no decay
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": s.weight_decay},
                             {"params": vectors, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    warmup = max(1, round(s.warmup * s.steps))
    log(f"model {config.model_type} {n_params:,} params; {s.steps} steps x {s.batch} x {s.seqlen} tokens "
        f"= {s.steps * s.batch * s.seqlen:,} tokens ({s.steps * s.batch / train_blocks.shape[0]:.2f} epochs)")

    losses: list[float] = []
    curve: list[dict] = []
    train_started = time.time()
    for step in range(s.steps):
        lr = cosine_lr(step, s.steps, s.lr, warmup, s.final_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        model.train()
        ids = batches.global_batch_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.precision == "bf16-mixed"):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        opt.step()
        losses.append(loss.item())
        last = step == s.steps - 1
        if step % 25 == 0 or last:
            per_step = (time.time() - train_started) / (step + 1)
            recent = losses[-25:]
            log(f"step {step:5d}/{s.steps} loss {losses[-1]:.4f} (avg {sum(recent) / len(recent):.4f}) lr {lr:.2e} "
                f"|g| {float(grad_norm):.2f} {per_step:.2f}s/step eta {per_step * (s.steps - step - 1):.0f}s")
        if (step + 1) % s.eval_every == 0 or last:
            probe_ppl = ppl(*window_nll(lambda ids: model(input_ids=ids).logits, probe, 16))
            curve.append({"step": step + 1, "tokens": (step + 1) * s.batch * s.seqlen, "val_probe_ppl": round(probe_ppl, 3),
                          "train_loss": round(sum(losses[-s.eval_every:]) / len(losses[-s.eval_every:]), 4)})
            log(f"eval step {step + 1}: val probe ppl {probe_ppl:.3f} ({probe.shape[0]} blocks)")
    train_wall = time.time() - train_started

    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    eval_started = time.time()
    heldout = heldout_ppl(out, corpus, s.seqlen)
    tail = losses[-50:]
    return {
        "arch": config.model_type,
        "n_params": n_params,
        "steps": s.steps,
        "batch": s.batch,
        "seqlen": s.seqlen,
        "tokens_seen": s.steps * s.batch * s.seqlen,
        "epochs": round(s.steps * s.batch / train_blocks.shape[0], 3),
        "final_train_loss": round(sum(tail) / len(tail), 4),
        "val_ppl": heldout["validation"]["ppl"],
        "test_ppl": heldout["test"]["ppl"],
        "heldout": heldout,
        "ppl_protocol": "elsa_ds.jobs.evaluate (launch/evaluate.py --ppl <corpus>/{validation,test}.jsonl --seqlen 256), "
                        "fp32, every window: BOS + 255 tokens, documents joined by EOS",
        "blocks": {"train": int(train_blocks.shape[0]), "validation": int(val_blocks.shape[0]),
                   "test": int(test_blocks.shape[0])},
        "tokens": {"train": int(train_blocks.numel()), "validation": int(val_blocks.numel()),
                   "test": int(test_blocks.numel())},
        "val_curve": curve,
        "warmup_steps": warmup,
        "settings": asdict(s),
        "tokenizer": {"type": "byte-level BPE", "vocab_size": len(tokenizer), "trained_on": "train split only",
                      "specials": {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3},
                      "post_processor": "TemplateProcessing '<bos> $A'" if s.add_bos else None,
                      "class_on_load": type(tokenizer).__name__,
                      "normalizer": json.loads(pipeline(tokenizer)[0]), "pre_tokenizer": json.loads(pipeline(tokenizer)[1])},
        "train_wall_s": round(train_wall, 1),
        "eval_wall_s": round(time.time() - eval_started, 1),
        "wall_s": round(time.time() - started, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": __import__("tokenizers").__version__, "python": platform.python_version()},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": s.threads},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="directory with train/validation/test.jsonl")
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES), required=True)
    ap.add_argument("--out", type=Path, required=True, help="output directory (must not exist)")
    ap.add_argument("--add_bos", action="store_true", help="tokenizer prepends <bos> (Llama style)")
    for name in ("steps", "batch", "seqlen", "vocab", "eval_every", "eval_blocks", "seed"):
        ap.add_argument(f"--{name}", type=int, default=getattr(TrainSettings, name))
    ap.add_argument("--lr", type=float, default=TrainSettings.lr)
    args = ap.parse_args(argv)
    s = TrainSettings(arch=args.arch, add_bos=args.add_bos, steps=args.steps, batch=args.batch, seqlen=args.seqlen,
                      vocab=args.vocab, eval_every=args.eval_every, eval_blocks=args.eval_blocks, seed=args.seed, lr=args.lr)
    print("settings:", json.dumps(asdict(s)), flush=True)
    if args.out.exists():
        raise SystemExit(f"--out {args.out} exists; choose a new directory")
    metrics = train(s, args.corpus.expanduser(), args.out, log=lambda m: print(m, flush=True))
    (args.out / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("val_curve", "settings")}), flush=True)


if __name__ == "__main__":
    main()
