"""The action a text asks for and the action a tool performs, as two views of the ranker.

A sentence embedding weighs nouns: "save this as notes.txt" lies close to `read_text_file`
(both about a text file), and "stage README.md" close to `read_file`. The verb is one word
among many there, yet it is what tells sibling tools of one server apart. So the ranker gets
the verb on its own: a small taxonomy of everyday English actions (create, read, list,
search, update, delete, move, send, the version-control verbs, ...), each a fine class in a
coarse family (read, list and search all retrieve). The text's action comes from its leading
verb (the first taxonomy verb of its opening words that is not used as a noun: "my list",
"the search"); a tool's from the verbs of its name and the leading verb of its description.

Two views per (text, tool), each 0 where either side names no action:

* `action`: 1 when they share a fine class ("save" and `write_file` both create);
* `clash`: 1 when they share no family ("save" and `read_text_file`: create vs retrieve).

Their weights are fitted with the other views' (`learned.RankerFit`); a calibration fitted
before them gives them 0. Pure: no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import regex

from .cases import _imperative, name_words
from .catalog import Tool

# fine class: (family, verbs). A verb may be in several classes ("show" reads or lists, "add"
# creates or, in git, stages); a text or tool then has all of them.
TAXONOMY: dict[str, tuple[str, str]] = {
    "read": ("retrieve", "read get show open view fetch retrieve display see load print check look inspect preview describe pull give grab "
                         "review summarize dump tell crawl scrape"),
    "list": ("retrieve", "list show enumerate browse"),
    "search": ("retrieve", "search find query lookup locate grep seek look"),
    "compare": ("retrieve", "diff compare"),
    "download": ("retrieve", "download export"),
    "compute": ("retrieve", "calculate compute analyze analyse estimate predict measure count detect"),  # tells, changes nothing
    "create": ("write", "create add new make write save store record generate build compose draft insert put post append raise attach "
                        "remember comment define bookmark jot"),
    "schedule": ("write", "schedule book plan arrange"),
    "update": ("write", "update edit change modify set rename replace patch fix adjust alter correct overwrite amend tweak mark toggle turn "
                        "rewrite swap flag assign fill enter tag label pin bump"),
    "complete": ("write", "complete finish resolve close archive"),
    "delete": ("write", "delete remove erase drop clear trash discard destroy purge wipe unlink detach nuke forget"),
    "move": ("write", "move relocate transfer copy duplicate rename put push"),
    "send": ("send", "send email mail message reply forward share notify post submit"),
    "respond": ("send", "respond reply rsvp accept decline"),
    "stage": ("stage", "stage add"),
    "unstage": ("reset", "unstage reset undo revert restore"),
    "commit": ("commit", "commit"),
    "push": ("push", "push publish upload attach"),
    "pull": ("pull", "pull sync"),
    "merge": ("merge", "merge"),
    "switch": ("switch", "checkout switch"),
    "branch": ("branch", "branch fork clone"),
    "run": ("run", "run execute launch start trigger invoke"),
    "stop": ("stop", "stop kill cancel abort terminate pause"),
    "navigate": ("navigate", "navigate visit"),
    "interact": ("interact", "click type press hover drag select scroll pick"),
    "convert": ("convert", "convert transform translate format"),
    "wait": ("wait", "wait"),
}
# Two-word verbs whose sense is not their first word's ("get rid of" deletes).
PHRASES: dict[tuple[str, str], str] = {
    ("get", "rid"): "delete", ("set", "up"): "create", ("pull", "up"): "read", ("look", "up"): "search", ("look", "for"): "search",
    ("look", "at"): "read", ("check", "off"): "complete", ("clean", "up"): "delete", ("turn", "on"): "update", ("turn", "off"): "update",
    ("write", "down"): "create", ("note", "down"): "create", ("jot", "down"): "create", ("find", "out"): "read",
    ("open", "a"): "create", ("open", "an"): "create", ("open", "new"): "create", ("take", "down"): "delete",
    ("kick", "off"): "run", ("go", "back"): "navigate",
}
CLASSES = tuple(TAXONOMY)
FAMILIES = tuple(dict.fromkeys(f for f, _ in TAXONOMY.values()))
VERBS_OF = {c: frozenset(v.split()) for c, (_, v) in TAXONOMY.items()}
VERBS: dict[str, frozenset[str]] = {}  # verb -> its classes
for _cls, _verbs in VERBS_OF.items():
    for _v in _verbs:
        VERBS[_v] = VERBS.get(_v, frozenset()) | {_cls}
LEADING_WORDS = 8  # a text's action is a verb among its opening words
# A taxonomy word right after these is a noun ("my list", "the search", "a new note").
_NOUN_AFTER = frozenset("a an the my your our their his her its this that these those each every any some no of".split())
# ... and right before these ("list of files", "search is slow", "email from Bob").
_NOUN_BEFORE = frozenset("of from is was are were has have 's".split())
# A question about what there is or what happened asks to retrieve ("what did I change").
_QUESTION = regex.compile(r"^\s*(?:what|what's|whats|which|who|whose|where|when|how\s+many|how\s+much|how's|hows|how\s+(?:big|long|old|far|is|are|was))\b"
                          r"|^\s*(?:is|are)\s+there\b|^\s*do\s+i\s+have\b|^\s*any\b",
                          regex.I)  # fmt: skip
_WORD = regex.compile(r"[a-z]+(?:'[a-z]+)?")
# A leading subordinate clause sets the scene; the request follows its comma ("Before moving
# it, I'll check the transitions").
_LEADING_CLAUSE = regex.compile(r"^\s*(?:before|after|once|when|while|if|since|as|to|now\s+that)\b[^,]{0,80},", regex.I)
# Sentences, and the steps of one ("..., then delete it", "... and after that send it").
_SENTENCES = regex.compile(r"[.!?;]+(?:\s+|$)|,?\s+(?:and\s+)?(?:then|after\s+that|afterwards)\b,?", regex.I)
# An -ing form after these is the action under way ("I'm saving it"), elsewhere often not ("in launching").
_PROGRESSIVE = frozenset("i'm im am are is we're now currently just also first next".split())
# A tool name's first verb that says how, not what: `start_search`, `API-post-search`.
_AUXILIARY = frozenset("start begin try post put patch".split())


def lemma(word: str) -> str | None:
    """A taxonomy verb a word is a form of: itself, or its -ing form ("saving", "setting")."""
    if word in VERBS:
        return word
    if word.endswith("ing") and len(word) > 5:
        stem = word[:-3]
        for base in (stem, stem + "e", stem[:-1] if stem[-1:] == stem[-2:-1] else ""):
            if base in VERBS:
                return base
    return None


class Action(msgspec.Struct, frozen=True):
    """Fine classes and families of one text or tool (both empty: no action known)."""

    classes: frozenset[str] = frozenset()
    families: frozenset[str] = frozenset()

    @classmethod
    def of_classes(cls, classes: frozenset[str]) -> Action:
        return cls(classes, frozenset(TAXONOMY[c][0] for c in classes))

    @classmethod
    def of_verbs(cls, verbs: Sequence[str]) -> Action:
        return cls.of_classes(frozenset().union(*(VERBS.get(v, frozenset()) for v in verbs)))


RETRIEVE = Action(frozenset(), frozenset({"retrieve"}))  # a question: some retrieval, which one unsaid


def of_text(text: str) -> Action:
    """The actions a request or a reply clause asks for: each sentence's (a text that asks for
    two things, "Find the file. Then delete it.", asks for both), `_sentence_action`."""
    found = [a for part in _SENTENCES.split(text) if part.strip() and (a := _sentence_action(part)) != Action()]
    if not found:
        return Action()
    return Action(frozenset().union(*(a.classes for a in found)), frozenset().union(*(a.families for a in found)))


def _sentence_action(text: str) -> Action:
    """A wh-question retrieves; else the first taxonomy verb among the opening words (or an
    -ing form where it is the action under way: "Saving it now", "I'm saving it"), unless
    used as a noun, read with the next word where the two say more ("get rid of"). No past
    forms: "the file I created" asks for no creation."""
    text = _LEADING_CLAUSE.sub("", text, count=1)
    if _QUESTION.match(text):
        return RETRIEVE
    words = _WORD.findall(text.lower())[:LEADING_WORDS]
    for i, w in enumerate(words):
        verb = w if w in VERBS else lemma(w) if i == 0 or words[i - 1] in _PROGRESSIVE else None
        after = words[i + 1] if i + 1 < len(words) else ""
        if i and words[i - 1] in _NOUN_AFTER:
            continue
        if verb is None:  # a two-word verb whose first word is none ("take down", "kick off")
            if (phrase := PHRASES.get((w, after))) is not None:
                return Action.of_classes(frozenset({phrase}))
            continue
        if after in _NOUN_BEFORE:
            continue
        if (phrase := PHRASES.get((verb, after))) is not None:
            return Action.of_classes(frozenset({phrase}))
        return Action.of_verbs([verb])
    return Action()


def of_tool(tool: Tool) -> Action:
    """What a tool does: the first taxonomy verb of its name, with any joined to it by "or" /
    "and" (`create_or_update_file`; later ones are mostly nouns: `read_email`, `git_log`), and
    its description's leading verb ("Unstages all staged changes" -> unstage). A verb that
    says how (`start_search`, `API-post-search`) gives way to the verb after it."""
    words = name_words(tool.bare_name).split()
    verbs: list[str] = []
    for i, w in enumerate(words):
        if w in VERBS and (not verbs or words[i - 1] in ("or", "and")):
            verbs.append(w)
        elif verbs == [words[i - 1]] and verbs[0] in _AUXILIARY and w in VERBS:
            verbs = [w]
        elif verbs and w not in ("or", "and"):
            break
    if verbs and set(verbs) <= VERBS_OF["read"] and len(words) > 1 and words[-1].endswith("s") and not words[-1].endswith("ss"):
        verbs.append("list")  # `get_tasks`: getting a plural lists
    lead = _WORD.findall(_imperative((tool.description or "").strip().split("\n", 1)[0][:40]).lower())
    return Action.of_verbs([*verbs, *(v for v in lead[:1] if lemma(v) == v)])


class ActionIndex:
    """A catalog's tool actions as (tools, classes) and (tools, families) indicator matrices,
    so a batch of texts gets both views in two products."""

    def __init__(self, tools: Sequence[Tool]):
        acts = [of_tool(t) for t in tools]
        self.classes = _indicators([a.classes for a in acts], CLASSES)
        self.families = _indicators([a.families for a in acts], FAMILIES)

    def views(self, texts: Sequence[str]) -> np.ndarray:
        """(texts, tools, 2): `action` (a shared fine class) and `clash` (no shared family)."""
        acts = [of_text(t) for t in texts]
        c = _indicators([a.classes for a in acts], CLASSES) @ self.classes.T
        f = _indicators([a.families for a in acts], FAMILIES)
        known = f.any(axis=1, keepdims=True) & self.families.any(axis=1)[None, :]
        clash = known & ((f @ self.families.T) == 0)
        return np.stack([(c > 0), clash], axis=-1).astype(np.float32)

    def narrow(self, mask: np.ndarray) -> ActionIndex:
        """The same index over the tools of `mask`."""
        out = object.__new__(ActionIndex)
        out.classes, out.families = self.classes[mask], self.families[mask]
        return out


def _indicators(sets: Sequence[frozenset[str]], names: Sequence[str]) -> np.ndarray:
    column = {n: j for j, n in enumerate(names)}
    out = np.zeros((len(sets), len(names)), np.float32)
    for r, s in enumerate(sets):
        out[r, [column[x] for x in s]] = 1.0
    return out
