"""A tiny random Qwen3 that "thinks": Qwen3's tokens for reasoning and tool calls and its real chat
template (Qwen/Qwen3-0.6B's, in tests/data), for the reasoning and Anthropic Messages tests and
for tests/vllm_compare_api.py (the same folder served by `vllm serve`).

`<think>`, `</think>`, `<tool_call>` and `</tool_call>` are single tokens, added to the tiny
tokenizer as Qwen3's tokenizer has them (added, not special: they stay in decoded text), so the
parsers see what a real Qwen3's output looks like.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE = Path(__file__).parent / "data" / "qwen3_chat_template.jinja"
THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def make_thinking_checkpoint(out_dir: Path) -> Path:
    """Write the checkpoint to `out_dir` (once; a folder with its marker is reused)."""
    from transformers import AutoTokenizer

    from registry.tiny import VOCAB_SIZE, make_tiny_checkpoint

    out = Path(out_dir)
    marker = out / "thinking.json"
    if marker.exists():
        return out
    make_tiny_checkpoint("qwen3", out, vocab_size=VOCAB_SIZE + len(THINK_TOKENS))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens(THINK_TOKENS)
    assert len(tokenizer) <= VOCAB_SIZE + len(THINK_TOKENS), len(tokenizer)
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.save_pretrained(out)
    marker.write_text("{}")
    return out


def think_ids(path: Path) -> dict[str, int]:
    """The ids of the four added tokens in the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return {t: tokenizer.convert_tokens_to_ids(t) for t in THINK_TOKENS}
