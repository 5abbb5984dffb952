"""Incremental detokenization with stop strings: emit text as soon as it is final.

Each step decodes only the last few tokens (constant work per token); held back are an
incomplete UTF-8 character and any tail that could still become a stop string.
"""

from __future__ import annotations


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        # Tokens [prefix_offset, read_offset) are decoded already and give the context that
        # byte-level and sentencepiece decoders need for the next token's spacing.
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        """Append a token and return the text that became final; sets `stopped` on a stop string."""
        self.token_ids.append(token_id)
        known = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        extended = self._decode(self.token_ids[self._prefix_offset :])
        if len(extended) <= len(known) or extended.endswith("\ufffd"):
            return ""
        self.text += extended[len(known) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        cut = self._stop_at(self.text)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._emit(cut)
        return self._emit(len(self.text) - self._holdback(self.text))

    def flush(self) -> str:
        """The rest of the text once generation has ended."""
        return self._emit(len(self.text))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted : end], end
        return piece

    def _stop_at(self, text: str) -> int | None:
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
