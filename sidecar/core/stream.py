"""Incremental segmentation of streamed LLM output into spans worth judging. Sans-I/O.

A tool should fire as early as the text allows, before the model's own tool call, so a
stream is judged clause by clause while it arrives: at a clause boundary (. ! ? ; : then
whitespace, or a newline), and, when a clause runs on, every `span_words` words. A span is
the clause so far, so a long clause is judged as it grows. The buffer holds only the
current clause and never more than `max_chars`: a clause that runs past it is judged and
cut, which bounds memory per stream whatever the client sends.

A terminator counts only when whitespace follows it ("3.14", "e.g", "http://x" are not
boundaries), so a boundary is confirmed one character late; `end()` flushes the rest.

A clause already judged is judged again only when it gained content words (`lexical.tokens`:
words other than stopwords, case aside): "let me search the notes" cut at `span_words` and
then ended by ", please." or "." adds nothing the gate could hear, so it is not emitted again
(`unchanged` counts those). `rejudge_unchanged=True` emits every longer span, as before.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import regex

from .lexical import tokens

TERMINATORS = frozenset(".!?;:")
CLOSERS = frozenset("\"')]}*_`»”’")  # may sit between a terminator and the whitespace
# Exactly the characters str.isspace() is true of (tests/test_stream.py checks), written out:
# finding them over every code point cost 50 ms of each process's start.
_SPACES = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
# A run of characters that only continue a word: `feed` steps over it at once instead of a
# character at a time (a flood of short clauses spent most of its event-loop time there).
_WORD_RUN = regex.compile("[^" + regex.escape(_SPACES + "".join(TERMINATORS) + "".join(CLOSERS), special_only=False) + "]+")

Reason = Literal["boundary", "words", "limit", "end"]


class Span(msgspec.Struct, frozen=True):
    """Text to judge: `text == stream[start:end]`, offsets in code points from the stream's start."""

    start: int
    end: int
    text: str
    reason: Reason


class Segmenter:
    """One stream's buffer. `feed(delta)` returns the spans that became ready."""

    def __init__(self, span_words: int = 12, max_chars: int = 512, min_alnum: int = 3, rejudge_unchanged: bool = False):
        if span_words < 1 or max_chars < 16:
            raise ValueError("span_words must be >= 1 and max_chars >= 16")
        self.span_words = span_words
        self.max_chars = max_chars
        self.min_alnum = min_alnum
        self.rejudge_unchanged = rejudge_unchanged
        self.unchanged = 0  # longer spans of a clause not emitted: no content word gained
        self.total = 0  # characters fed so far: the next delta starts at this offset
        self.ended = False
        self._buf = ""  # the current clause is _buf[_off:], from stream offset _base
        self._off = 0  # clauses cut within one feed move this, not the text: a frame of many short clauses stays linear
        self._base = 0
        self._scan = 0  # _buf[:_scan] has been looked at
        self._term: int | None = None  # index of a terminator waiting for its whitespace
        self._words = 0  # words completed since the clause began or was last judged
        self._in_word = False
        self._last: tuple[int, int] | None = None  # the last span emitted, never repeated
        self._last_words: list[str] | None = None  # its content words

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._off

    def feed(self, delta: str) -> list[Span]:
        if self.ended:
            raise ValueError("stream already ended")
        out: list[Span] = []
        self._buf += delta
        self.total += len(delta)
        i = self._scan
        while i < len(self._buf):
            if i - self._off >= self.max_chars:  # checked first, so no branch below can skip it
                space = self._buf.rfind(" ", self._off + self.max_chars // 2, i)
                cut = space if space > self._off else i
                self._emit(cut, "limit", out)
                i = self._rebase(cut)
                continue
            c = self._buf[i]
            if self._term is not None:
                if c in TERMINATORS or c in CLOSERS:
                    i += 1
                    continue
                if c.isspace():
                    self._emit(self._term, "boundary", out)
                    i = self._rebase(i)
                    continue
                self._term = None  # "3.14", "e.g": a terminator inside a word
            if c == "\n":
                self._emit(i, "boundary", out)
                i = self._rebase(i + 1)
                continue
            if c in TERMINATORS:
                self._term = i
            elif c.isspace():
                if self._in_word:
                    self._in_word = False
                    self._words += 1
                    if self._words >= self.span_words:
                        self._emit(i, "words", out)
                        self._words = 0
            else:
                self._in_word = True
                run = _WORD_RUN.match(self._buf, i, self._off + self.max_chars)  # never past the cut above
                if run is not None:
                    i = run.end()
                    continue
            i += 1
        off = self._off  # drop the clauses cut in this feed: one copy a feed, not one a clause
        self._buf, self._scan, self._off = self._buf[off:], i - off, 0
        if self._term is not None:
            self._term -= off
        return out

    def end(self) -> list[Span]:
        """Flush what is left (a pending terminator ends the clause). Idempotent."""
        if self.ended:
            return []
        self.ended = True
        out: list[Span] = []
        self._emit(self._term if self._term is not None else len(self._buf), "end", out)
        self._rebase(len(self._buf))
        return out

    def _emit(self, stop: int, reason: Reason, out: list[Span]) -> None:
        """Append the clause `_buf[_off:stop]`, trimmed, unless it is too short or a repeat."""
        raw = self._buf[self._off : stop]
        text = raw.strip()
        if not self._enough_alnum(text):
            return
        start = self._base + (len(raw) - len(raw.lstrip()))
        end = start + len(text)
        if self._last == (start, end):
            return
        words = tokens(text)
        if self._last is not None and self._last[0] == start and words == self._last_words and not self.rejudge_unchanged:
            self.unchanged += 1  # the same clause, grown by punctuation, spaces or stopwords only
            return
        self._last, self._last_words = (start, end), words
        out.append(Span(start, end, text, reason))

    def _enough_alnum(self, text: str) -> bool:
        """At least `min_alnum` letters or digits, counted until there are enough."""
        seen = 0
        for ch in text:
            if ch.isalnum():
                seen += 1
                if seen >= self.min_alnum:
                    return True
        return seen >= self.min_alnum

    def _rebase(self, at: int) -> int:
        """Start a new clause at `_buf[at]`; returns the scan position."""
        self._base += at - self._off
        self._off = at
        self._term = None
        self._words = 0
        self._in_word = False
        return at
