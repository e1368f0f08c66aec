"""Pattern files: the regex half of the tiered gate.

A pattern file holds one pattern per line::

    # comment
    @verbs create make write save read search        # a named word list
    let_me (llm) \\b(let\\s+me|let's)\\s+\\L<verbs>\\b  # id, optional source scope, regex

Named lists are the `regex` module's ``\\L<name>`` feature, so one verb vocabulary
serves every pattern without pasting a long alternation into each. A line that does not
compile stops start-up with ``file:line``. Matching is time-bounded (``timeout=``), so a
catastrophically backtracking pattern costs at most its budget and is reported, never
stalls the gate.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

import msgspec
import regex

SOURCES = ("user", "llm")
PATTERNS_DIR = pathlib.Path(__file__).resolve().parent.parent / "patterns"
_ID = regex.compile(r"[A-Za-z][\w.-]*")
_LIST = regex.compile(r"@(?P<name>[A-Za-z]\w*)\s+(?P<words>.+)")
_FLAGS = regex.IGNORECASE | regex.VERSION1


class PatternError(ValueError):
    """A pattern file is broken; the message starts with file:line."""


class Pattern(msgspec.Struct, frozen=True):
    id: str
    regex: regex.Pattern
    sources: tuple[str, ...]
    origin: str  # file:line, for reports


class Match(msgspec.Struct, frozen=True):
    id: str
    text: str
    start: int
    end: int


class PatternSet:
    """An ordered list of compiled patterns with a per-search time budget."""

    def __init__(self, patterns: Iterable[Pattern], timeout_s: float = 0.02):
        self.patterns = tuple(patterns)
        self.timeout_s = timeout_s
        self.timeouts = 0  # searches abandoned at the budget, for metrics

    def __len__(self) -> int:
        return len(self.patterns)

    def first(self, text: str, source: str) -> Match | None:
        """The first pattern (file order) matching `text`, or None."""
        for p in self.patterns:
            if source not in p.sources:
                continue
            try:
                m = p.regex.search(text, timeout=self.timeout_s)
            except TimeoutError:
                self.timeouts += 1
                continue
            if m:
                return Match(p.id, m.group(0), m.start(), m.end())
        return None


def parse(text: str, origin: str, lists: dict[str, list[str]] | None = None) -> tuple[list[Pattern], dict[str, list[str]]]:
    """Parse one pattern file against the @lists known so far; returns its patterns and the lists after it."""
    lists = {k: list(v) for k, v in (lists or {}).items()}
    patterns: list[Pattern] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        where = f"{origin}:{lineno}"
        line = _strip_comment(raw).strip()
        if not line:
            continue
        if line.startswith("@"):
            m = _LIST.fullmatch(line)
            if not m:
                raise PatternError(f"{where}: a list line reads '@name word word ...'")
            # Multi-word entries are written with '_' ("look_up") and match one space.
            lists.setdefault(m["name"], []).extend(w.replace("_", " ") for w in m["words"].split())
            continue
        pid, _, rest = line.partition(" ")
        rest = rest.strip()
        if not _ID.fullmatch(pid) or not rest:
            raise PatternError(f"{where}: expected 'ID [(user)|(llm)] REGEX', got {raw.strip()!r}")
        if pid in seen:
            raise PatternError(f"{where}: duplicate id {pid!r} (first at line {seen[pid]})")
        seen[pid] = lineno
        sources: tuple[str, ...] = SOURCES
        scope = regex.match(r"\((user|llm)\)\s+", rest)
        if scope:
            sources, rest = (scope[1],), rest[scope.end():]
        used = set(regex.findall(r"\\L<(\w+)>", rest))
        missing = used - lists.keys()
        if missing:
            raise PatternError(f"{where}: unknown list {', '.join(sorted(missing))} (define it with '@name words')")
        try:
            compiled = regex.compile(rest, _FLAGS, **{k: lists[k] for k in used})
        except regex.error as e:
            raise PatternError(f"{where}: {e}") from None
        patterns.append(Pattern(pid, compiled, sources, where))
    return patterns, lists


def _strip_comment(line: str) -> str:
    """Drop a whole-line comment or a trailing ' # comment' (a '#' in a regex has no space before it)."""
    if line.lstrip().startswith("#"):
        return ""
    cut = line.find(" #")
    return line if cut < 0 else line[:cut]


class GatePatterns(msgspec.Struct, frozen=True):
    negative: PatternSet
    high: PatternSet


def load_dir(directory: pathlib.Path | str = PATTERNS_DIR, timeout_s: float = 0.02) -> GatePatterns:
    """Read lists.txt (word lists), then negative.txt and high.txt, from one directory."""
    directory = pathlib.Path(directory)
    lists: dict[str, list[str]] = {}
    sets: dict[str, list[Pattern]] = {}
    for name in ("lists", "negative", "high"):
        path = directory / f"{name}.txt"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise PatternError(f"{path}:0: cannot read pattern file ({e.strerror})") from None
        sets[name], lists = parse(text, str(path), lists)
    if sets["lists"]:
        raise PatternError(f"{directory / 'lists.txt'}: holds only @lists, found pattern {sets['lists'][0].id!r}")
    return GatePatterns(PatternSet(sets["negative"], timeout_s), PatternSet(sets["high"], timeout_s))
