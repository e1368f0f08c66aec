"""Use-case phrases for a tool, and how a strategy renders them for embedding.

Real catalogs ship descriptions, not use cases: long, third person ("Retrieves ..."),
full of caveats ("Only works within allowed directories", "Error Responses: 400").
A match against a short request works best against short imperative phrases, so we
derive them: the name as words, the title, the description's leading sentence(s)
rewritten to the imperative, and the items of any "use this tool to:" list.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import regex

from .catalog import Tool

MAX_CASES = 6
MAX_WORDS = 18
MAX_DESCRIPTION_CHARS = 2000  # of a description that cases are derived from

# Strategy modifiers, as in the embedding study behind the design.
MODIFIERS = ("base", "prefix", "mcp", "llm", "action")

# Verbs with their synonyms, used by the `action` strategy to vary a case's leading verb.
ACTION_SYNONYMS: dict[str, tuple[str, ...]] = {
    "create": ("make", "add", "write"),
    "write": ("save", "store", "record"),
    "save": ("store", "persist", "record"),
    "read": ("open", "load", "view"),
    "get": ("fetch", "retrieve", "look up"),
    "list": ("show", "enumerate"),
    "search": ("find", "look for", "query"),
    "find": ("search for", "look up"),
    "update": ("edit", "modify", "change"),
    "edit": ("modify", "change", "update"),
    "delete": ("remove", "erase", "drop"),
    "remove": ("delete", "clear"),
    "run": ("execute", "launch"),
    "send": ("post", "deliver"),
    "navigate": ("go to", "open", "visit"),
    "take": ("capture",),
    "move": ("rename", "relocate"),
    "download": ("fetch", "get"),
}

_LEAD_INS = regex.compile(
    r"^(?:(?:use\s+)?this\s+(?:tool|function|endpoint)\s+(?:is\s+used\s+to|lets\s+you|allows\s+you\s+to|allows|will|can|to|is\s+for|helps\s+(?:you\s+)?)|"
    r"(?:a\s+)?tool\s+(?:to|for|that)|(?:used|allows\s+you|lets\s+you)\s+to|(?:this\s+)?(?:tool|function)\s*:|"
    r"you\s+can\s+use\s+this\s+to|use\s+(?:this\s+|it\s+)?(?:tool\s+)?(?:to|for)|"
    r"use\s+(?:this\s+)?(?:tool\s+)?when\s+(?:you\s+|the\s+user\s+)?(?:need|want|wants|needs)s?\s+to|useful\s+(?:for|to))\s+",
    regex.I,
)
_DROP_SENTENCE = regex.compile(
    r"\b(deprecated|only\s+works\s+within|error\s+responses?|warning|note:|important:|must\s+be\s+called|"
    r"requires?\s+(?:a|an|the)\s+\w+\s+(?:token|key)|returns?\s+(?:an?\s+)?(?:error|json|list\s+of\s+results)|"
    r"if\s+the\s+\w+\s+(?:does\s+not|doesn't)\s+exist|\bparameters?\b|\bargs?\b:)",
    regex.I,
)
# A later sentence is kept only when it states a use, not a caveat or a format.
_USE_SENTENCE = regex.compile(r"^(use\s+(this|it)\b|useful\s+(for|to)|ideal\s+for|helps?\s+)", regex.I)
_NOT_PROSE = regex.compile(r"[{}<>=]|\b(usage|example|e\.g\.|i\.e\.)\b|\bonly\s*$", regex.I)
_USE_LIST = regex.compile(r"use\s+(?:this\s+)?(?:tool\s+)?(?:to|when|for)\s*(?::\s*)?$", regex.I)  # not \s*:?\s*: quadratic on spaces
_BULLET = regex.compile(r"^\s*(?:[-*•]|\d+[.)])\s+(.+)$")
_MARKUP = regex.compile(r"\*\*|__|`|^#+\s*|\[([^\]]*)\]\([^)]*\)")
_PIPE_PREFIX = regex.compile(r"^\s*[\w .-]{1,30}\s*\|\s*")  # "Notion | Update a block"
_WORD_SPLIT = regex.compile(r"[_\-\s./:]+|(?<=[a-z0-9])(?=[A-Z])")
_NAME_NOISE = {"api", "tool", "mcp"}
_SENTENCE_END = regex.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])|\n\s*\n|\s+/\s+")


def name_words(name: str) -> str:
    """'create_or_update_file' -> 'create or update file'; 'API-get-block-children' -> 'get block children'."""
    words = [w for w in _WORD_SPLIT.split(name) if w and w.lower() not in _NAME_NOISE]
    return " ".join(w.lower() for w in words)


def _imperative(phrase: str) -> str:
    """'Retrieves the list of users' -> 'retrieve the list of users' (first word only)."""
    first, _, rest = phrase.partition(" ")
    low = first.lower()
    if low.endswith("ies") and len(low) > 4:
        base = low[:-3] + "y"
    elif low.endswith(("sses", "shes", "ches", "xes", "zes", "oes")):
        base = low[:-2]
    elif low.endswith("s") and not low.endswith(("ss", "us", "is")) and len(low) > 3:
        base = low[:-1]
    else:
        base = low if first[:1].isupper() and not first[1:2].isupper() else first
    return f"{base} {rest}".strip()


def _drop_parentheticals(phrase: str) -> str:
    """Each "(" with the white space before it, through the next ")" (parentheticals rarely
    carry intent). A loop of finds: the regex it replaces rescanned the rest of the text from
    every "(" with no ")" after it (5.1 s for 60,000 of them)."""
    out, i = [], 0
    while (j := phrase.find("(", i)) >= 0 and (k := phrase.find(")", j)) >= 0:
        out.append(phrase[i:j].rstrip())
        i = k + 1
    out.append(phrase[i:])
    return "".join(out)


def _clip(phrase: str) -> str:
    """Keep the head of a long phrase, cutting at a clause boundary when one is near."""
    phrase = _drop_parentheticals(phrase)
    phrase = phrase.strip(" .:;,-")
    words = phrase.split()
    if len(words) <= MAX_WORDS:
        return phrase
    head = " ".join(words[:MAX_WORDS])
    cut = max(head.rfind(","), head.rfind(";"), head.rfind(" - "))
    return (head[:cut] if cut > len(head) // 2 else head).strip(" .:;,-")


def _sentences(description: str) -> tuple[list[str], list[str]]:
    """Split a description into plain sentences and 'use this tool to:' list items. The text
    is capped before any regex sees it (MAX_DESCRIPTION_CHARS): a client's hello brings
    descriptions, and a regex that backtracks costs the square of what it reads. The phrases
    come from the first sentences anyway."""
    text = _PIPE_PREFIX.sub("", description[:MAX_DESCRIPTION_CHARS].strip())
    lines = [_MARKUP.sub(lambda m: m.group(1) or "", ln).strip() for ln in text.splitlines()]
    uses: list[str] = []
    prose: list[str] = []
    in_use_list = False
    for ln in lines:
        if not ln or ln.startswith("#"):
            in_use_list = False
            prose.append("")  # paragraph break
            continue
        bullet = _BULLET.match(ln)
        if bullet and in_use_list:
            uses.append(bullet.group(1))
            continue
        if _USE_LIST.search(ln):
            in_use_list = True
            continue
        in_use_list = False
        if bullet:
            continue  # other bullet lists describe parameters or results
        prose.append(ln)
    sentences: list[str] = []
    for para in " ".join(prose).split("  "):
        sentences += [s.strip() for s in _SENTENCE_END.split(para) if s and s.strip()]
    return sentences, uses


def derive(tool: Tool, max_cases: int = MAX_CASES) -> list[str]:
    """Use-case phrases for a tool: its own `cases` if it has them, else derived ones."""
    if tool.cases:
        return list(tool.cases)
    out: list[str] = []
    name = name_words(tool.bare_name)
    if tool.title and name_words(tool.title) != name:
        out.append(tool.title.strip())
    out.append(name)
    sentences, uses = _sentences(tool.description or "")
    for i, s in enumerate(sentences):
        if (i > 0 and not _USE_SENTENCE.match(s)) or _DROP_SENTENCE.search(s) or _NOT_PROSE.search(s):
            continue
        s = _LEAD_INS.sub("", s)
        phrase = _clip(_imperative(s))
        if len(phrase.split()) >= 2:
            out.append(phrase)
    out.extend(_clip(_imperative(u)) for u in uses[:3])
    return _unique(out)[:max_cases]


def _unique(items: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for it in items:
        key = it.lower()
        if it and key not in seen:
            seen.add(key)
            out.append(it)
    return out


class Strategy(msgspec.Struct, frozen=True):
    """A set of modifiers: which texts represent a tool in the index."""

    prefix: bool = False  # "create_note: write a new document"
    mcp: bool = False  # "MCP tool create_note: write a new document" (implies the name)
    llm: bool = False  # adds "I should call create_note", "Let me use the create_note tool", ...
    action: bool = False  # adds leading-verb variants: "persist ...", "record ..."

    @classmethod
    def parse(cls, spec: str) -> Strategy:
        parts = [p for p in regex.split(r"[+,\s]+", spec.strip().lower()) if p]
        unknown = [p for p in parts if p not in MODIFIERS]
        if not parts or unknown:
            raise ValueError(f"unknown strategy {spec!r}: combine {', '.join(MODIFIERS)} with '+' (e.g. prefix+mcp)")
        return cls(**{p: True for p in parts if p != "base"})

    def __str__(self) -> str:
        parts = [m for m in MODIFIERS[1:] if getattr(self, m)]
        return "+".join(parts) or "base"

    def render(self, tool: Tool, cases: list[str]) -> list[str]:
        """The texts to embed for one tool, best-known phrasing first."""
        label = tool_label(tool)
        phrases = list(cases)
        if self.action:
            phrases += [v for c in cases for v in _verb_variants(c)]
        if self.mcp:
            texts = [f"MCP tool {label}: {c}" for c in phrases]
        elif self.prefix:
            texts = [f"{label}: {c}" for c in phrases]
        else:
            texts = phrases
        if self.llm:
            texts += [
                f"I should call {label}",
                f"Let me use the {label} tool",
                f"I need to invoke {label}",
            ]
            texts += [f"Let me {_lower_first(c)}" for c in cases[1:3]]
        return _unique(texts)


def tool_label(tool: Tool) -> str:
    """How the tool is named in an indexed text: the server's name for it, with the server."""
    if tool.server and tool.name != tool.bare_name:
        return f"{tool.server} {tool.bare_name}"
    return tool.name


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[1:2].islower() or len(s) == 1 else s


def _verb_variants(case: str) -> list[str]:
    first, _, rest = case.partition(" ")
    syns = ACTION_SYNONYMS.get(first.lower(), ())
    return [f"{s} {rest}".strip() for s in syns]
