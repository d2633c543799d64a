"""Tiny random-initialised models of every architecture the README names, sharing the tests' small BPE tokenizer.

Shapes are ragged on purpose (hidden 36, intermediate 99): on 2 ranks every weight's ZeRO-3 partition boundary
falls inside a row and the last rank carries padding, so a slice that maps one rank's share wrongly shows.
"""
from __future__ import annotations

from pathlib import Path

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 36, 99, 2, 512
IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}


def arch_config(arch: str):
    """The transformers config of a tiny ``arch`` (llama, mistral, qwen2, opt, gemma, gemma2, gemma3_text, gemma3)."""
    import transformers as tf

    common = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
              "max_position_embeddings": 256, **IDS}
    decoder = {**common, "intermediate_size": INTERMEDIATE, "num_key_value_heads": 1}
    gemma3_text = {**decoder, "head_dim": 18, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
                   "query_pre_attn_scalar": 18}
    if arch == "llama":
        return tf.LlamaConfig(**decoder)
    if arch == "mistral":
        return tf.MistralConfig(**decoder, sliding_window=32)
    if arch == "qwen2":  # q/k/v carry biases
        return tf.Qwen2Config(**decoder, tie_word_embeddings=True)
    if arch == "gemma":
        return tf.GemmaConfig(**decoder, head_dim=18)
    if arch == "gemma2":
        return tf.Gemma2Config(**decoder, head_dim=18, sliding_window=32)
    if arch == "gemma3_text":  # a sliding-window layer (window 32 < seqlen 64) and a full-attention one, 2 heads / 1 KV head
        return tf.Gemma3TextConfig(**gemma3_text)
    if arch == "gemma3":  # Gemma3ForConditionalGeneration: a tiny SigLIP vision tower beside the same text decoder
        vision = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                  "patch_size": 14}
        return tf.Gemma3Config(text_config=gemma3_text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                               boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2, **IDS)
    if arch == "opt":  # model.decoder.layers, learned positions (offset 2), biases everywhere, tied embeddings
        # dropout 0: OPT's configs ship dropout 0.1, which training keeps (model.train()), and its random draws differ
        # between the reference and ZeRO-3, so masks could not be compared entry by entry
        return tf.OPTConfig(**common, ffn_dim=INTERMEDIATE, word_embed_proj_dim=HIDDEN, do_layer_norm_before=True, dropout=0.0)
    raise ValueError(arch)


ARCHS = ("llama", "mistral", "qwen2", "opt", "gemma", "gemma2", "gemma3_text")


def make_arch_model(directory: Path, arch: str, tokenizer_dir: Path) -> Path:
    """Save a tiny random ``arch`` model (fp32) with the tokenizer of ``tokenizer_dir`` into ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(arch_config(arch)).save_pretrained(directory)
    return directory
