"""Pattern files: the regex half of the tiered gate.

A pattern file holds one pattern per line::

    # comment
    @verbs create make write save read search        # a named word list
    let_me (llm) \\b(let\\s+me|let's)\\s+\\L<verbs>\\b  # id, optional source scope, regex

Named lists are the `regex` module's ``\\L<name>`` feature, so one verb vocabulary
serves every pattern without pasting a long alternation into each. A line that does not
compile stops start-up with ``file:line``, and so does one that repeats a group that
itself repeats without bound (``(a+)+``, ``(\\w*)*``: catastrophic backtracking).

Each search has a time budget (``timeout=``): `timeout_s` per `BUDGET_CHARS` characters of
text, since linear patterns take time in proportion to it, up to `MAX_BUDGET_FACTOR` times.
Negative patterns read the whole text (a negative phrase anywhere blocks); high ones only
its first `MAX_SCREEN_CHARS` characters (about what the larger model reads: evidence for
firing comes from the text that is embedded). A search cut off at its budget is counted per
pattern set, logged once per pattern, and treated as its set says: a negative pattern that
timed out blocks (fails closed), a high one counts as no match.

The budget is measured by `regex` in CPU time of the whole process, not of the search
(measured: a search timed out at 110 ms of process CPU having had 57 ms of its own while
another thread hashed, and did not time out at all in a process stopped for longer than its
budget). So other threads' work counts against it: llama.cpp's threads spin while they wait,
the event loop runs beside them, and a short text that needs microseconds can find its
budget spent while it waited for the GIL or a core, and be blocked for nothing. A search
cut off having had less than `STARVED_SHARE` of its budget on its own thread's CPU was
starved, not slow: it runs once more with `RETRY_FACTOR` times the budget, and only that
run's timeout counts. A pathological pattern spends its budget on its own thread and is cut
off at it, as before; starved as well, it costs at most 1 + `RETRY_FACTOR` budgets and still
fails closed.
"""

from __future__ import annotations

import importlib.resources
import logging
import pathlib
import time
from collections import Counter
from collections.abc import Iterable

import msgspec
import regex

log = logging.getLogger("sidecar.patterns")

MAX_SCREEN_CHARS = 8192  # what high patterns read of a text (nomic-embed reads 2,048 tokens, ~8k chars)
BUDGET_CHARS = 2048  # the time budget covers this many characters; a longer text gets it pro rata ...
MAX_BUDGET_FACTOR = 50  # ... up to this many times (1 s at the default 20 ms, for 100k characters)
STARVED_SHARE = 0.5  # a search cut off with less than this share of its budget on its own thread was starved ...
RETRY_FACTOR = 10  # ... and runs once more with this many times the budget

SOURCES = ("user", "llm")
BUILTIN = "sidecar.builtin_patterns"  # the project's patterns/ folder, installed as package data
_ID = regex.compile(r"[A-Za-z][\w.-]*")
_LIST = regex.compile(r"@(?P<name>[A-Za-z]\w*)\s+(?P<words>.+)")
_FLAGS = regex.IGNORECASE | regex.VERSION1
# VERSION1 folds case fully under IGNORECASE ("ß" matches "ss"), which expands every letter of
# every list word into its foldings: the built-in files compiled in 130-180 ms (a tenth of a warm
# start) and each span was screened in 190-320 us. Simple folding (still "É" = "é") compiles them
# in 50-90 ms and screens in 110-170 us; no word list or pattern here has a letter it would miss.
_SIMPLE_FOLDING = "(?-f)"


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
    timed_out: bool = False  # a fail-closed set's search hit its budget: an empty match at 0


class PatternSet:
    """An ordered list of compiled patterns with a per-search time budget. `fail_closed`:
    a search that hits the budget counts as a match (negative patterns: when in doubt, block)."""

    def __init__(self, patterns: Iterable[Pattern], timeout_s: float = 0.02, *, name: str = "patterns",
                 fail_closed: bool = False, max_chars: int | None = None):  # fmt: skip
        self.patterns = tuple(patterns)
        self.timeout_s = timeout_s
        self.name = name
        self.fail_closed = fail_closed
        self.max_chars = max_chars  # read only this head of a text (None: all of it)
        self.timeouts = 0  # searches abandoned at the budget, for /metrics
        self.retries = 0  # searches run again because other threads spent their budget (see _search)
        self.timeouts_by_id: Counter[str] = Counter()
        self._logged: set[str] = set()

    def __len__(self) -> int:
        return len(self.patterns)

    def budget_s(self, chars: int) -> float:
        """The time one search of a `chars`-long text may take: linear patterns take time in
        proportion to the text, so the budget does too, up to a bound."""
        return self.timeout_s * min(max(1.0, chars / BUDGET_CHARS), MAX_BUDGET_FACTOR)

    def first(self, text: str, source: str, within: float | None = None) -> Match | None:
        """The first pattern (file order) matching `text` (its head, with `max_chars`), or None.
        `within`: all the searches within this many seconds of process CPU time, else
        `Unsettled`, nothing counted (a caller that must not wait on a slow text, such as the
        event loop, leaves it to one that may)."""
        if self.max_chars is not None:
            text = text[:self.max_chars]
        budget = self.budget_s(len(text))
        cpu = time.thread_time()  # once a text: the clock is a system call (~70 us in a VM), a search of a short text ~5 us
        deadline = None if within is None else time.process_time() + within  # regex's timeout runs on the process's CPU clock too
        for p in self.patterns:
            if source not in p.sources:
                continue
            try:
                m = self._search(p, text, budget, cpu) if deadline is None else self._search_by(p, text, deadline)
            except _CutOff as cut:
                self._timed_out(p, len(text), cut.budget)
                if self.fail_closed:
                    return Match(p.id, "", 0, 0, timed_out=True)
                continue
            if m:
                return Match(p.id, m.group(0), m.start(), m.end())
        return None

    def _search_by(self, p: Pattern, text: str, deadline: float) -> regex.Match | None:
        """`p` searched in what is left until `deadline` (process CPU time); Unsettled past it."""
        left = deadline - time.process_time()
        if left <= 0:
            raise Unsettled(self.name)
        try:
            return p.regex.search(text, timeout=left)
        except TimeoutError:
            raise Unsettled(self.name) from None

    def _search(self, p: Pattern, text: str, budget: float, cpu: float) -> regex.Match | None:
        """`p` searched within `budget` (of process CPU time); a search that other threads
        starved (cut off before its own thread had `STARVED_SHARE` of the budget since `cpu`,
        the text's first search: the searches before it took microseconds, or timed out) gets one more
        run at `RETRY_FACTOR` times it. _CutOff when the pattern itself took the time, or the
        retry ran out too."""
        try:
            return p.regex.search(text, timeout=budget)
        except TimeoutError:
            if time.thread_time() - cpu >= STARVED_SHARE * budget:
                raise _CutOff(budget) from None
        self.retries += 1
        try:
            return p.regex.search(text, timeout=budget * RETRY_FACTOR)
        except TimeoutError:
            raise _CutOff(budget * RETRY_FACTOR) from None

    def _timed_out(self, p: Pattern, chars: int, budget: float) -> None:
        """Count it; say it once per pattern (a log line per text would flood the log)."""
        self.timeouts += 1
        self.timeouts_by_id[p.id] += 1
        if p.id not in self._logged:
            self._logged.add(p.id)
            verdict = "treated as a match (blocks)" if self.fail_closed else "treated as no match"
            log.warning("%s pattern %r (%s) was cut off at %.0f ms on a %d-char text: %s; "
                        "further timeouts of it are only counted (sidecar_regex_timeouts_total)",
                        self.name, p.id, p.origin, budget * 1000, chars, verdict)  # fmt: skip


class Unsettled(Exception):
    """A pattern set's searches did not finish within the time they were given (`first`'s
    `within`): what the text matches is not known yet."""


class _CutOff(TimeoutError):
    """A search abandoned at `budget` seconds (its retry's budget, when it was starved)."""

    def __init__(self, budget: float):
        super().__init__(f"regex search cut off at {budget * 1000:.0f} ms")
        self.budget = budget


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
            compiled = regex.compile(_SIMPLE_FOLDING + rest, _FLAGS, **{k: lists[k] for k in used})
        except regex.error:
            try:  # the error as written (its position without the prefix)
                regex.compile(rest, _FLAGS, **{k: lists[k] for k in used})
            except regex.error as e:
                raise PatternError(f"{where}: {e}") from None
            raise
        if nested := nested_quantifier(rest):
            raise PatternError(f"{where}: nested quantifier {nested!r}: a group that repeats without bound is itself "
                               "repeated without bound (catastrophic backtracking); bound one ({1,N}), or make it "
                               "possessive (++, *+) or atomic ((?>...))")  # fmt: skip
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


def load_dir(directory: pathlib.Path | str | None = None, timeout_s: float = 0.02) -> GatePatterns:
    """Read lists.txt (word lists), then negative.txt and high.txt, from one directory (None:
    the built-in ones, read as package data so a wheel has them too)."""
    directory = pathlib.Path(directory) if directory is not None else importlib.resources.files(BUILTIN)
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
    return GatePatterns(PatternSet(sets["negative"], timeout_s, name="negative", fail_closed=True),
                        PatternSet(sets["high"], timeout_s, name="high", max_chars=MAX_SCREEN_CHARS))  # fmt: skip


# The nested-quantifier lint ---------------------------------------------------------------

_UNBOUNDED = regex.compile(r"[*+]|\{\d*,\}")  # a quantifier with no upper bound
_QUANTIFIER = regex.compile(r"(?:[*+?]|\{\d*(?:,\d*)?\})([+?]?)")


class _Group:
    """A group being scanned: where it opened, and whether something inside it repeats
    without bound (atomic groups never backtrack into themselves, so they do not count)."""

    def __init__(self, start: int, atomic: bool):
        self.start = start
        self.atomic = atomic
        self.repeats = False


def nested_quantifier(src: str) -> str | None:
    """The first group in a regex that repeats without bound and holds something that also
    repeats without bound (``(a+)+``, ``(?:\\w*\\s)*``), as written; None when there is none.
    Possessive quantifiers (``a++``) do not backtrack and do not count."""
    stack: list[_Group] = [_Group(0, False)]
    i = 0
    while i < len(src):
        c = src[i]
        group: _Group | None = None
        if c == "\\":
            i = _skip_escape(src, i)
        elif c == "[":
            i = _skip_class(src, i)
        elif c == "(":
            if src.startswith("(?#", i):
                i = src.find(")", i) + 1 or len(src)
                continue
            stack.append(_Group(i, src.startswith("(?>", i)))
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            group = stack.pop()
            i += 1
        else:
            i += 1
        q = _QUANTIFIER.match(src, i)
        if q is None:
            if group is not None and group.repeats and not group.atomic:
                stack[-1].repeats = True
            continue
        unbounded = _UNBOUNDED.match(q.group(0)) is not None and q.group(1) != "+"
        if group is not None and unbounded and group.repeats and not group.atomic:
            return src[group.start:q.end()]
        if unbounded or (group is not None and group.repeats and not group.atomic):
            stack[-1].repeats = True
        i = q.end()
    return None


def _skip_escape(src: str, i: int) -> int:
    """Past one escape: \\L<name>, \\p{...}, \\N{...}, or a backslash and one character."""
    nxt = src[i + 1:i + 2]
    if nxt == "L" and src.startswith("<", i + 2):
        return src.find(">", i) + 1 or len(src)
    if nxt in ("p", "P", "N", "x", "u", "U") and src.startswith("{", i + 2):
        return src.find("}", i) + 1 or len(src)
    return i + 2


def _skip_class(src: str, i: int) -> int:
    """Past a character class (nested classes and set operations included)."""
    depth, i = 1, i + 1
    if src.startswith("^", i):
        i += 1
    if src.startswith("]", i):
        i += 1
    while i < len(src) and depth:
        c = src[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        i += 1
    return i
