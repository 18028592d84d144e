"""A tiny random Llama saved as a Hugging Face folder, with a byte-level tokenizer, built
offline: the main job's base model, so its adapters export to PEFT and load with peft."""

from __future__ import annotations

from pathlib import Path

from megatron_multilora.atomic_files import write_dir_atomic

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endfor %}"


def byte_level_tokenizer():
    """UTF-8 bytes as tokens behind transformers' tokenizer API: 0 = pad, 1 = bos, 2 = eos,
    byte b -> b + 3 (the ids of the built-in ByteTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_level_chars()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chars[b]: 3 + b for b in range(256)}}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _byte_level_chars() -> dict[int, str]:
    """The byte-level pre-tokenizer's alphabet: printable bytes stand for themselves, the
    others for chr(256 + i) in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return chars


def write_tiny_llama(
    folder: str | Path,
    hidden_size: int = 128,
    num_layers: int = 2,
    seed: int = 0,
    max_positions: int = 256,
) -> Path:
    """Save a random Llama (4 heads, 2 KV groups, SwiGLU 2x hidden, vocab 264, sequences of
    up to ``max_positions``) and the byte tokenizer to ``folder`` (atomically)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=264,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    tokenizer = byte_level_tokenizer()

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_dir_atomic(folder, fill, overwrite=True)
