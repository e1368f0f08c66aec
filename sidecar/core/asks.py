"""A user turn's asks: "find the flight, then book it and email me the receipt" is three, each
with its own tool (issue 31). Pure and English-first: sentences, then the connectives people
chain requests with ("then", "after that", "; ", ", and" or "and" before a request verb). The
engine gates and ranks each ask on its own, so a sentence that asks for nothing ("I need your
help with a few things.") adds nothing; a turn of one ask is judged exactly as before.
"""

from __future__ import annotations

import regex

MAX_ASKS = 8  # a turn's asks beyond these are not ranked on their own
MAX_CHARS = 2000  # of a turn that is split (regexes here see no more)
MIN_WORDS = 2  # a shorter piece ("ok") is no ask of its own

_SENTENCE = regex.compile(r"(?<=[.!?])\s+(?=[\p{Lu}\"'(])")
_VERBS = (
    "add|analy[sz]e|book|calculate|cancel|check|compare|convert|create|delete|download|email|estimate|fetch|find|get|give|list|look up|"
    "make|move|open|order|play|post|provide|read|remove|rename|reply|retrieve|save|schedule|search|send|set|share|show|tell|translate|"
    "update|upload|write"
)
_CONNECTIVE = regex.compile(
    rf"\s*(?:;|\n+|,?\s+and then\s+|,\s*then\s+|\s+then\s+(?=(?:{_VERBS})\b)|,?\s+after that,?\s+|,?\s+and\s+(?=(?:also\s+)?(?:{_VERBS})\b))\s*",
    regex.I,
)
_LEAD = regex.compile(r"^(?:first(?:ly)?|second(?:ly)?|then|next|after that|finally|lastly|also|additionally|and)\b[,:]?\s*", regex.I)


def split(text: str) -> list[str]:
    """The asks of `text`, in order (one, the text itself, when it chains nothing)."""
    pieces: list[str] = []
    for sentence in _SENTENCE.split(text[:MAX_CHARS].strip()):
        pieces += [_LEAD.sub("", p.strip(" ,.;:")).strip() for p in _CONNECTIVE.split(sentence)]
    asks = [p for p in pieces if len(p.split()) >= MIN_WORDS]
    return asks[:MAX_ASKS] if len(asks) > 1 else [text]
