"""What a query asks for, and what a tool does, as sets of word stems.

Users say "save"; tools are named write_file. Both sides are reduced to crude stems
("saving", "saves", "save" -> "sav") and the query's action verbs are widened through an
action map (save -> write, create, store, edit, modify, update), so the recommender can
boost tools whose names carry the intended action and penalise the ones that contradict it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import msgspec
import regex

from ..core.catalog import Tool
from ..core.lexical import STOPWORDS
from ..core.lexical import words as lexical_words

_WORD = regex.compile(r"[\p{L}\p{N}]+")

IRREGULAR = {
    "written": "write", "wrote": "write", "got": "get", "gotten": "get", "made": "make", "found": "find",
    "ran": "run", "sent": "send", "took": "take", "taken": "take", "gave": "give", "given": "give",
    "saw": "see", "seen": "see", "shown": "show", "kept": "keep", "left": "leave", "built": "build",
    "did": "do", "done": "do", "went": "go", "put": "put", "set": "set", "cut": "cut",
}
# -ed words that are not past tenses ("embed", "need" must not lose their ending).
_ED_WORDS = frozenset("embed need feed speed seed bed red shred bleed breed proceed exceed succeed unmed".split())


@functools.lru_cache(maxsize=65536)
def stem(word: str) -> str:
    """A crude, consistent stem: applied to both query and tool words, it only has to agree
    with itself ("creating", "created", "create" -> "creat"). Memoised: a catalog's words
    repeat (462 tools: 18,912 words, most of the recommender's first-use build)."""
    w = word.lower()
    w = IRREGULAR.get(w, w)
    if len(w) <= 3:
        return w
    if w.endswith("ing") and len(w) >= 6:
        w = w[:-3]
        if w[-1] == w[-2] and w[-1] not in "lsz":
            w = w[:-1]  # running -> run, getting -> get
    elif w.endswith("ed") and len(w) >= 5 and w not in _ED_WORDS:
        w = w[:-2]
        if w[-1] == w[-2] and w[-1] not in "lsz":
            w = w[:-1]  # stopped -> stop
    elif w.endswith("ies") and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith(("sses", "shes", "ches", "xes", "zes")):
        w = w[:-2]
    elif w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    if w.endswith("e") and len(w) > 3:
        w = w[:-1]
    return w


def words(text: str) -> list[str]:
    """Lower-cased words with snake_case, kebab-case and camelCase split (the lexical index's
    words, so both read a tool the same way)."""
    return [w.lower() for w in lexical_words(text)]


def stems(words_: Iterable[str]) -> frozenset[str]:
    return frozenset(stem(w) for w in words_ if w not in STOPWORDS)


def _s(spec: str) -> frozenset[str]:
    return frozenset(stem(w) for w in spec.split())


# What a verb in a query may be called in a tool's name. Every verb maps to itself too.
_ACTION_SPEC = {
    "save": "write create store edit modify update put persist",
    "store": "write save create put persist",
    "persist": "write save store",
    "record": "write save store create log add",
    "write": "write save create edit update put",
    "load": "read get open fetch load",
    "open": "open read get navigate view",
    "show": "view display read get list describe",
    "display": "view show read get",
    "view": "view read get show display",
    "see": "view read get show list",
    "read": "read get open view load fetch",
    "get": "get read fetch retrieve",
    "fetch": "fetch get read retrieve download",
    "retrieve": "retrieve get fetch read",
    "download": "download fetch get",
    "modify": "edit update change modify patch",
    "change": "edit update change modify set",
    "edit": "edit update modify change patch",
    "update": "update edit modify change patch set",
    "fix": "edit update patch",
    "rename": "rename move",
    "move": "move rename",
    "remove": "delete clear drop remove",
    "delete": "delete remove clear drop",
    "erase": "delete remove clear",
    "clear": "clear delete remove reset",
    "drop": "drop delete remove",
    "create": "create add new make insert",
    "add": "add create insert append new",
    "make": "create make add new",
    "insert": "insert add create",
    "append": "append add update",
    "new": "create new add",
    "find": "find search query lookup locate",
    "search": "search find query lookup",
    "look": "search find lookup get",
    "lookup": "lookup search find get",
    "locate": "find search locate",
    "query": "query search find",
    "list": "list show enumerate",
    "browse": "browse navigate list open",
    "navigate": "navigate open visit go",
    "visit": "navigate open visit",
    "go": "navigate go open",
    "click": "click press",
    "press": "press click",
    "type": "type fill",
    "fill": "fill type",
    "run": "run execute exec start invoke",
    "execute": "execute run exec invoke",
    "start": "start run launch",
    "stop": "stop kill cancel terminate",
    "kill": "kill stop terminate",
    "send": "send post publish reply",
    "post": "post send publish",
    "reply": "reply send post",
    "notify": "notify send post",
    "upload": "upload put push",
    "push": "push upload",
    "pull": "pull fetch download",
    "commit": "commit",
    "merge": "merge",
    "copy": "copy duplicate clone",
    "clone": "clone copy",
    "analyze": "analyze inspect examine review check",
    "inspect": "inspect examine analyze get",
    "check": "check verify validate test status",
    "verify": "verify validate check test",
    "test": "test verify check",
    "capture": "capture screenshot snapshot take",
    "screenshot": "screenshot capture snapshot",
    "summarize": "summarize",
    "translate": "translate convert",
    "convert": "convert transform export",
    "export": "export convert download",
    "import": "import upload load",
    "install": "install add",
    "remember": "store save create add remember",
    "recall": "search read get retrieve",
    "think": "think reason",
    "plan": "plan think",
    "schedule": "schedule create",
    "close": "close",
    "resize": "resize",
    "wait": "wait",
    "evaluate": "evaluate run execute",
}
ACTION_MAP: dict[str, frozenset[str]] = {stem(k): _s(v) | {stem(k)} for k, v in _ACTION_SPEC.items()}
ACTION_WORDS: frozenset[str] = frozenset(ACTION_MAP) | frozenset().union(*ACTION_MAP.values())

# Intent families for the conflict penalties.
WRITE_INTENT = _s("save store persist record write edit modify update change append put fix create add make insert")
READ_INTENT = _s("load open show display view see read get fetch retrieve")
CREATE_INTENT = _s("create add make insert new")
DELETE_INTENT = _s("remove delete erase clear drop")
# Verbs in a tool's name that say what it does.
TOOL_READS = _s("read get list search find view show fetch query describe inspect lookup count check retrieve download tree info status stat")
TOOL_WRITES = _s("write save store create edit update modify set put insert append add patch replace upload")
TOOL_DELETES = _s("delete remove clear drop erase destroy purge unlink trash")
TOOL_MUTATES = TOOL_WRITES | TOOL_DELETES | _s("move rename push commit merge send post publish fill type click run execute close")

DOMAINS: dict[str, frozenset[str]] = {
    name: _s(spec)
    for name, spec in {
        "code": "code function class method variable symbol repo repository commit branch source refactor compile lint bug diff",
        "web": "web browser page website url http html link site scrape crawl navigate click tab dom",
        "data": "data csv json database table sql query row column spreadsheet excel dataset schema collection record",
        "files": "file directory folder path filesystem",
        "documentation": "docs documentation guide api reference manual readme library",
        "security": "security vulnerability audit permission auth token secret credential password encrypt",
        "memory": "memory knowledge remember recall note entity relation graph observation",
        "test": "test e2e integration unit verify assert spec",
        "communication": "message email slack channel chat post notify reply thread",
        "project": "issue ticket jira confluence task sprint board project milestone",
        "time": "time timezone date clock calendar schedule",
        "media": "image picture photo video screenshot audio art",
        "cloud": "aws s3 bucket lambda cloud kubernetes docker",
        "maps": "map location place address route direction geocode",
        "research": "paper arxiv research article",
    }.items()
}

TECH_TERMS = _s(
    "api json csv sql http https url html css git github gitlab regex python javascript typescript node npm "
    "docker kubernetes aws s3 pdf markdown yaml xml graphql rest websocket token oauth database postgres "
    "postgresql mysql sqlite mongodb redis elasticsearch browser dom selector screenshot commit branch pr "
    "issue repository function class method variable symbol login schema index bucket lambda endpoint cli "
    "shell bash terminal process file directory jira confluence slack notion excel spreadsheet arxiv"
)
_TECH_SHAPE = regex.compile(r"\d|\.|[a-z][A-Z]|_|^[A-Z]{2,}$")


class Intent(msgspec.Struct, frozen=True):
    query: str
    terms: tuple[str, ...]  # stems of the content words, in order, each once
    actions: tuple[str, ...]  # the terms that are action verbs
    domains: tuple[str, ...]
    technical: tuple[str, ...]
    wants_write: bool
    wants_read: bool
    wants_create: bool
    wants_delete: bool


def analyze(query: str) -> Intent:
    raw = [m for m in _WORD.findall(query)]
    terms: list[str] = []
    technical: list[str] = []
    for token in raw:
        for w in words(token):
            if w in STOPWORDS or len(w) < 2:
                continue
            s = stem(w)
            if s not in terms:
                terms.append(s)
            if (s in TECH_TERMS or _TECH_SHAPE.search(token)) and s not in technical and s not in ACTION_WORDS:
                technical.append(s)
    actions = tuple(t for t in terms if t in ACTION_MAP)
    tset = set(terms)
    doms = tuple(d for d, keys in DOMAINS.items() if tset & keys)
    aset = set(actions)
    return Intent(
        query=query,
        terms=tuple(terms),
        actions=actions,
        domains=doms,
        technical=tuple(technical),
        wants_write=bool(aset & WRITE_INTENT),
        wants_read=bool(aset & READ_INTENT),
        wants_create=bool(aset & CREATE_INTENT),
        wants_delete=bool(aset & DELETE_INTENT),
    )


class ToolProfile(msgspec.Struct, frozen=True):
    name_words: frozenset[str]
    desc_words: frozenset[str]
    verbs: frozenset[str]  # action stems in the name, plus the description's leading verb
    domains: frozenset[str]
    terms: frozenset[str]  # name words and technical terms: what the term index keys on
    read_only: bool
    write_only: bool
    deletes: bool


def profile(tool: Tool) -> ToolProfile:
    """What the tool's name, description and MCP annotations say it does."""
    name = stems(words(tool.bare_name) + words(tool.title or ""))
    desc_list = [w for w in words(tool.description) if w not in STOPWORDS]
    desc = stems(desc_list)
    name_verbs = name & ACTION_WORDS
    lead = stem(desc_list[0]) if desc_list else ""
    verbs = name_verbs | ({lead} if lead in ACTION_WORDS else set())
    ann = tool.annotations or {}
    hint = ann.get("readOnlyHint")
    if hint is True:
        read_only = True
    elif hint is False:
        read_only = False
    else:
        read_only = bool(name_verbs & TOOL_READS) and not name_verbs & TOOL_MUTATES
    write_only = bool(name_verbs & TOOL_WRITES) and not name_verbs & TOOL_READS and hint is not True
    everything = name | desc
    return ToolProfile(
        name_words=name,
        desc_words=desc,
        verbs=frozenset(verbs),
        domains=frozenset(d for d, keys in DOMAINS.items() if everything & keys),
        terms=frozenset(name | (desc & TECH_TERMS)),
        read_only=read_only,
        write_only=write_only,
        deletes=bool(name_verbs & TOOL_DELETES),
    )
