"""Train the embedded demo model: a 4.2M-parameter Gemma-2 on Shakespeare, with its own BPE tokenizer.

    python -m elsa_ds.demo.train_demo --out elsa_ds/demo/model --overwrite

Fits in about 12 minutes on 2 CPU cores. Train split: every play but ``elsa_ds.data.shakespeare.VALIDATION_PLAYS``. The
tokenizer is a byte-level BPE of 4096 tokens with Gemma's special ids (<pad>=0, <eos>=1, <bos>=2,
<unk>=3) and no post-processor, so ``tokenizer(text)`` adds nothing; blocks are packed exactly as the
pruning job packs them (``elsa_ds.data.pack_blocks``: BOS first in every block, EOS between plays), and
``val_ppl`` is measured over all validation blocks packed the same way (the pruning report's protocol when the model
was made; the report now uses ``elsa_ds.data.windows``, so its dense figure differs from ``val_ppl``).

Precision: the weights, AdamW state and the final evaluation are fp32; the training forward/backward
runs under bf16 autocast (``--precision bf16-mixed``), which halves the step time on a CPU with
AVX512-BF16 and so doubles the steps that fit in the budget (``--precision fp32`` for pure fp32: 400
steps gave val ppl 96.8 there, against ~750 mixed-precision steps in the same time).

Writes ``--out`` (config, fp32 safetensors, tokenizer, ``training_metrics.json``) via ``<out>.tmp``;
an existing ``--out`` is replaced only once the new one is complete.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Gemma2Config, Gemma2ForCausalLM, PreTrainedTokenizerFast

from elsa_ds.data import GlobalBatches, pack_blocks
from elsa_ds.data.shakespeare import VALIDATION_PLAYS, split_texts
from elsa_ds.evaluation.perplexity import ppl, window_nll
from elsa_ds.errors import stderr_line

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3 in this order, Gemma's convention


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style): every string round-trips, so ``<unk>`` exists only for Gemma's id layout."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for want, token in enumerate(SPECIALS):
        assert tok.token_to_id(token) == want, (token, tok.token_to_id(token))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def demo_config(vocab_size: int) -> Gemma2Config:
    """Gemma-2 in miniature: GQA (4 q / 2 kv heads), alternating sliding/full attention, softcapping kept.

    Eager attention because SDPA/flash ignore Gemma-2's attention-logit softcapping.
    """
    return Gemma2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        sliding_window=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
        # accepted at runtime (PreTrainedConfig.__init__ takes it from **kwargs), but not in the typed signature
        attn_implementation="eager",  # type: ignore[call-arg]
    )


def cosine_lr(step: int, total_steps: int, peak: float, warmup: int, final_ratio: float) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then half-cosine down to ``final_ratio · peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min((step - warmup) / max(total_steps - 1 - warmup, 1), 1.0)
    return peak * (final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def save_atomically(out: Path, model: Gemma2ForCausalLM, tokenizer: PreTrainedTokenizerFast, metrics: dict) -> None:
    """Write everything beside ``out`` under this process's own temporary names, then swap it in; a crash leaves the old
    ``out`` intact (``check_out`` ran before the training)."""
    tmp, old = out.with_name(f".{out.name}.{os.getpid()}.tmp"), out.with_name(f".{out.name}.{os.getpid()}.old")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    if old.exists():
        shutil.rmtree(old)


def check_out(out: Path, overwrite: bool) -> None:
    """Before the training: ``out`` is new, empty, or (with --overwrite) an earlier demo model, never another folder;
    else one line and exit 2."""
    refusal = None
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        refusal = f"--out {out} is not a folder of its own (a file or a link): choose another path"
    elif out.is_dir() and any(out.iterdir()) and not (out / "training_metrics.json").is_file():  # said first: no
        refusal = f"--out {out} holds no demo model (no training_metrics.json): it is never replaced; choose another path"
    elif out.is_dir() and any(out.iterdir()) and not overwrite:  # --overwrite offered only where it would be taken
        refusal = f"--out {out} is not empty: pass --overwrite to replace an earlier demo model there"
    if refusal:
        stderr_line(f"train_demo: error: {refusal}")
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "model", help="output directory")
    ap.add_argument("--steps", type=int, default=750, help="optimizer steps (750 ≈ 12 min on 2 cores in bf16-mixed)")
    ap.add_argument("--batch", type=int, default=16, help="blocks per step")
    ap.add_argument("--seqlen", type=int, default=256, help="tokens per block, BOS included")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=float, default=0.05, help="warm-up as a fraction of --steps")
    ap.add_argument("--final_lr_ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    ap.add_argument("--weight_decay", type=float, default=0.1, help="AdamW decay on matrices (not norms)")
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size, specials included")
    ap.add_argument("--seed", type=int, default=0, help="model init and block order")
    ap.add_argument("--precision", choices=["bf16-mixed", "fp32"], default="bf16-mixed",
                    help="training compute dtype; weights, optimizer and evaluation stay fp32")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier demo model at --out")
    return ap.parse_args(argv)


def build(args: argparse.Namespace, vocab_size: int) -> tuple[Gemma2ForCausalLM, torch.optim.Optimizer]:
    """The demo model (seeded) and AdamW with decay on matrices only."""
    torch.manual_seed(args.seed)
    model = Gemma2ForCausalLM(demo_config(vocab_size))
    model.train()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm scales: decaying them only hurts
    opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": args.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    return model, opt


def train(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, batches: GlobalBatches) -> list[float]:
    """The training loop: cosine schedule with warm-up, bf16 autocast (or fp32), clipping at 1.0; returns the losses."""
    warmup = max(1, round(args.warmup * args.steps))
    losses: list[float] = []
    started = time.time()
    for step in range(args.steps):
        lr = cosine_lr(step, args.steps, args.lr, warmup, args.final_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = batches.global_batch_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            per_step = (time.time() - started) / (step + 1)
            recent = losses[-25:]
            print(f"step {step:4d}/{args.steps} loss {losses[-1]:.4f} (avg {sum(recent) / len(recent):.4f}) "
                  f"lr {lr:.2e} |g| {float(grad_norm):.2f} {per_step:.2f}s/step "
                  f"eta {per_step * (args.steps - step - 1):.0f}s", flush=True)
    return losses


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_out(args.out, args.overwrite)
    print("config:", json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}), flush=True)
    torch.set_num_threads(args.threads)
    started = time.time()

    # data: tokenizer from the train split only, so validation plays are unseen by BPE too
    train_texts, val_texts = split_texts("train"), split_texts("validation")
    tokenizer = train_tokenizer(train_texts, args.vocab)

    def blocks(texts: list[str]) -> torch.Tensor:
        ids = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts)
        return pack_blocks(ids, args.seqlen, tokenizer.bos_token_id, tokenizer.eos_token_id)

    train_blocks, val = blocks(train_texts), blocks(val_texts)
    batches = GlobalBatches(train_blocks, args.batch, args.batch, world_size=1, rank=0, seed=args.seed)
    print(f"tokenizer {len(tokenizer)} tokens; blocks train {tuple(train_blocks.shape)} val {tuple(val.shape)}; "
          f"{time.time() - started:.0f}s", flush=True)
    model, opt = build(args, len(tokenizer))
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    print(f"model {n_params:,} params", flush=True)
    losses = train(args, model, opt, batches)

    model.eval()
    val_ppl = ppl(*window_nll(lambda ids: model(input_ids=ids).logits, val, args.batch))  # fp32, the report's protocol
    last = losses[-20:]
    metrics = {
        "steps": args.steps, "batch": args.batch, "seqlen": args.seqlen, "tokens_seen": args.steps * args.batch * args.seqlen,
        "final_train_loss": round(sum(last) / len(last), 4), "val_ppl": round(val_ppl, 3), "train_blocks": int(train_blocks.shape[0]),
        "val_blocks": int(val.shape[0]), "n_params": n_params, "wall_s": round(time.time() - started, 1), "seed": args.seed,
        "lr": args.lr, "warmup_steps": max(1, round(args.warmup * args.steps)), "final_lr_ratio": args.final_lr_ratio,
        "precision": args.precision, "weight_decay": args.weight_decay, "vocab_size": len(tokenizer),
        "validation_plays": list(VALIDATION_PLAYS), "torch": torch.__version__, "transformers": transformers.__version__,
    }
    save_atomically(args.out, model, tokenizer, metrics)
    print(json.dumps(metrics, indent=2), flush=True)
    print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
