"""Token ids -> text deltas for one request: incremental detokenization and stop strings.

Decoding the whole output on every step costs O(n²) per request; decoding only the tokens since
the last emitted point also gets word boundaries wrong (a leading-space marker decodes differently
at the start of a text). So each step decodes a window: the tokens of the previous delta (context)
plus the new ones, and emits the difference (the scheme vLLM uses). A window whose text ends in
U+FFFD is an incomplete multi-byte character: it is held back until the next token completes it.

Stop strings may span deltas, so up to (longest stop string - 1) characters are held back until
the request finishes; the text stops before the stop string, which is not part of the output.
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0  # window start: the first token of the previous delta
        self.read = 0  # tokens already turned into text
        self.text = ""  # all text decoded so far (stop string cut off once found)
        self.sent = 0  # characters handed out
        self.stopped = False  # a stop string was found

    def add(self, ids: list[int], final: bool = False) -> str:
        """Feed new token ids; returns the text that may be sent now (all of it when final)."""
        if self.stopped:
            return ""
        self.ids += ids
        if len(self.ids) > self.read:
            before = self.decode(self.ids[self.prefix:self.read])
            now = self.decode(self.ids[self.prefix:])
            if len(now) > len(before) and (final or not now.endswith("\ufffd")):
                start = len(self.text)
                self.text += now[len(before):]
                self.prefix, self.read = self.read, len(self.ids)
                self._find_stop(start)
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def _find_stop(self, start: int) -> None:
        if not self.stop:
            return
        lo = max(0, start - self.hold)  # a stop string may begin in text decoded earlier
        hits = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
