"""A tiny random gpt-oss that speaks harmony: gpt-oss's channel tokens (`<|start|>`,
`<|channel|>`, `<|message|>`, `<|end|>`, `<|return|>`, `<|call|>`, `<|constrain|>`) added to
the tiny tokenizer as special tokens, as o200k_harmony has them, and a short harmony chat
template (the generation prompt ends with `<|start|>assistant`, as gpt-oss's own template
does), for the `openai_gptoss` reasoning tests (#43).
"""

from __future__ import annotations

from pathlib import Path

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- else -%}"
    "<|start|>{{ 'developer' if m.role == 'system' else m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def make_harmony_checkpoint(out_dir: Path) -> Path:
    """Write the checkpoint to `out_dir` (once; a folder with its marker is reused)."""
    from transformers import AutoTokenizer

    from registry.tiny import VOCAB_SIZE, make_tiny_checkpoint

    out = Path(out_dir)
    marker = out / "harmony.json"
    if marker.exists():
        return out
    make_tiny_checkpoint("gpt_oss", out, vocab_size=VOCAB_SIZE + len(HARMONY_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    assert len(tokenizer) <= VOCAB_SIZE + len(HARMONY_TOKENS), len(tokenizer)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    marker.write_text("{}")
    return out


def harmony_ids(path: Path) -> dict[str, int]:
    """The ids of the harmony tokens, and of the first token of `analysis` and `final`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in HARMONY_TOKENS}
    for word in ("analysis", "final"):
        ids[word] = tokenizer.encode(word, add_special_tokens=False)[0]
    return ids
