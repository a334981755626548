"""Incremental detokenization with stop strings.

Text is decoded over a short sliding window of tokens (the last few prompt tokens give
the first output tokens their context, e.g. a leading space). A token that ends in the
middle of a multi-byte character decodes to '\ufffd'; such text is held back until the
character completes. When stop strings are set, the last len(longest stop) - 1
characters are held back from streaming too, since they could begin a stop string.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text and streamable deltas.

    Args:
        tokenizer: a Hugging Face tokenizer, or None (text stays empty).
        prompt_token_ids: the prompt, for context of the first output tokens.
        skip_special_tokens: leave special tokens out of the text.
        stop: stop strings to look for in new text (runtime.engine.stop decides whether a match ends it).
        include_stop_str_in_output: keep the matched stop string in the text.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
        stop: list[str] | None = None, include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        # The Rust tokenizer behind a fast HF tokenizer decodes several times faster than
        # the Python wrapper (no argument conversion); same text with cleanup off.
        self._fast = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids = context  # window tokens followed by output tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._match: tuple[int, str] | None = None  # (index in output_text, stop string) of the last update
        self.output_text = ""
        self._sent = 0  # characters of output_text already streamed
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the first stop string that the text they added contains, if any.

        The text is not cut here: if runtime.engine.stop decides the match ends the request, the
        caller calls `stop_at_match()`.
        """
        self._match = None
        if self.tokenizer is None or self.stopped:
            return None
        old_len = len(self.output_text)
        for token in new_token_ids:
            self._ids.append(token)
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
                self.output_text += full[len(prefix_text):]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        if self.stop and len(self.output_text) > old_len:
            self._match = self._find_stop(old_len)
        return self._match[1] if self._match else None

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in text added after `old_len`."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.output_text.find(s, max(0, old_len - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        return best

    def stop_at_match(self) -> None:
        """End the text at the stop string the last update found (kept if include_stop_str_in_output)."""
        if self._match is None:
            raise RuntimeError("stop_at_match() without a stop string found by the last update()")
        idx, s = self._match
        self.output_text = self.output_text[: idx + len(s) if self.include_stop else idx]
        self.stopped = True

    def flush(self) -> None:
        """At the end, emit held-back bytes of an incomplete character (as '\ufffd')."""
        if self.tokenizer is None or self.stopped or self._read_offset >= len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self.output_text += full[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._ids)

    def delta(self, finished: bool) -> str:
        """Text not streamed yet; while unfinished, keeps back what may start a stop string."""
        if finished:
            self.flush()
        end = len(self.output_text)
        if not finished and self.stop:
            end = max(self._sent, end - self.holdback)
        out = self.output_text[self._sent:end]
        self._sent = end
        return out

    def streamed_text(self) -> str:
        """What has been streamed so far (equals output_text once finished)."""
        return self.output_text[: self._sent]
