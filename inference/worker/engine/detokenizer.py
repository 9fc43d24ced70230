"""Token ids in, text deltas out: never half a character, never any part of a stop string."""

from inference.protocol.text import partial_tail


class IncrementalDetokenizer:
    """Decodes a growing list of ids in a short window, like vLLM's detokenizer.

    `text` is everything decoded so far (cut at a stop string once one appears); `released`
    counts the characters handed out. A tail that could still grow into a stop string is held
    back until it can no longer match, and text ending in U+FFFD waits for the rest of its bytes.
    """

    def __init__(self, tokenizer, stop=()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.released = 0
        self.stopped = False

    def add(self, token_id):
        """Feed one produced id; returns the text that is now safe to show."""
        self.ids.append(token_id)
        self.text += self._decode_new()
        self._cut_at_stop()
        return self._release(self._safe_end())

    def flush(self):
        """The sequence is over: hand out what was held back (no stop string can complete now)."""
        return self._release(len(self.text))

    def _decode_new(self):
        window = self.ids[self.prefix_offset :]
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(window)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for its next bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _cut_at_stop(self):
        if self.stopped or not self.stop:
            return
        # A stop string can only start in the part not yet released.
        start = max(0, self.released - max(map(len, self.stop)))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _safe_end(self):
        if self.stopped:
            return len(self.text)
        return len(self.text) - partial_tail(self.text, self.stop)

    def _release(self, end):
        end = max(end, self.released)
        delta = self.text[self.released : end]
        self.released = end
        return delta
