"""The hand-written evaluation data: labelled sets and transcripts stay valid and balanced."""

import json

import pytest

from sidecar.core import catalog
from sidecar.lab import evaluate

from .conftest import ROOT

FIXTURES = ROOT / "fixtures"
LABELED = FIXTURES / "labeled"
TRANSCRIPTS = FIXTURES / "transcripts"
SETS = ["dev.jsonl", "heldout.jsonl"]


@pytest.fixture(scope="module")
def cat():
    return catalog.load([FIXTURES / "catalogs" / "ALL.json"])


@pytest.fixture(scope="module")
def sets(cat):
    return {name: evaluate.read_labeled(LABELED / name, cat) for name in SETS}


@pytest.mark.parametrize("name", SETS)
def test_labeled_set_is_balanced(sets, name):
    items = sets[name]
    n = len(items)
    pos = [i for i in items if i.positive]
    assert n >= 150
    assert len(pos) >= 0.35 * n, f"{name}: {len(pos)}/{n} positives"
    assert n - len(pos) >= 0.35 * n, f"{name}: {n - len(pos)}/{n} negatives"
    sources = {i.source for i in items}
    assert sources == {"user", "llm"}
    for src in ("user", "llm"):
        assert sum(i.source == src for i in items) >= 0.25 * n, f"{name}: too few {src} lines"
        assert any(i.positive and i.source == src for i in items)
        assert any(not i.positive and i.source == src for i in items)
    servers = {t.split("__", 1)[0] for i in pos for t in i.expected}
    assert len(servers) >= 20, f"{name}: positives cover only {len(servers)} servers"
    texts = [i.text for i in items]
    assert len(texts) == len(set(texts)), f"{name}: duplicate lines"


def test_no_text_in_both_sets(sets):
    norm = lambda s: " ".join(s.lower().split())  # noqa: E731
    dev = {norm(i.text) for i in sets["dev.jsonl"]}
    heldout = {norm(i.text) for i in sets["heldout.jsonl"]}
    assert not dev & heldout


def _transcript_lines():
    files = sorted(TRANSCRIPTS.glob("*.jsonl"))
    assert files, "no transcripts"
    for path in files:
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                yield f"{path.name}:{no}", json.loads(line)


def test_transcripts_are_valid(cat):
    conversations, calls, chunked, assistant = set(), 0, 0, 0
    for where, m in _transcript_lines():
        assert set(m) <= {"conversation", "role", "content", "chunks", "tool_calls"}, where
        assert isinstance(m["conversation"], str) and m["conversation"], where
        assert m["role"] in ("user", "assistant", "tool"), where
        assert isinstance(m["content"], str) and m["content"], where
        conversations.add(m["conversation"])
        if "chunks" in m:
            assert m["role"] == "assistant", where
            assert all(isinstance(c, str) and c for c in m["chunks"]), where
            assert "".join(m["chunks"]) == m["content"], where
        if "tool_calls" in m:
            assert m["role"] == "assistant", where
            for c in m["tool_calls"]:
                assert cat.get(c["name"]) is not None, f"{where}: unknown tool {c['name']}"
                assert isinstance(c.get("arguments", {}), dict), where
                calls += 1
        if m["role"] == "assistant":
            assistant += 1
            chunked += "chunks" in m
    assert 8 <= len(conversations) <= 12
    assert calls > 0
    assert 0.3 * assistant <= chunked <= 0.7 * assistant


def test_transcripts_include_turns_without_tools():
    plain = [m for _, m in _transcript_lines() if m["role"] == "assistant" and not m.get("tool_calls")]
    assert plain


# the verb probe of issue 30 item 4: judged against these servers' own catalogs, merged as server__tool
VERBS_SERVERS = ["filesystem", "git", "github", "notes", "google-calendar", "gmail", "todoist"]


def test_verb_probe_is_valid_and_pairs_nouns_with_different_verbs():
    cat = catalog.load([FIXTURES / "catalogs" / f"{s}.json" for s in VERBS_SERVERS])
    items = evaluate.read_labeled(LABELED / "verbs.jsonl", cat)  # every expected tool is in the catalogs
    assert len(items) >= 200
    texts = [i.text.casefold() for i in items]
    assert len(texts) == len(set(texts)), "duplicate lines"
    pos = [i for i in items if i.positive]
    assert {i.source for i in pos} == {"user", "llm"} and any(not i.positive for i in items)
    assert {t.split("__", 1)[0] for i in pos for t in i.expected} == set(VERBS_SERVERS)
    assert all(i.group for i in pos), "every request names the noun it shares (group)"
    # a request counts as paired when another request about the same noun expects none of its tools
    by_group: dict[str, list] = {}
    for i in pos:
        by_group.setdefault(i.group, []).append(i)
    paired = [i for i in pos if any(not (o.expected & i.expected) for o in by_group[i.group])]
    assert len(paired) >= 0.6 * len(pos), f"only {len(paired)}/{len(pos)} requests share a noun with a different action"
