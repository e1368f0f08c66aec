"""Use-case derivation from real descriptions, and strategy rendering."""

import pytest

from sidecar.core import catalog, cases
from sidecar.core.cases import Strategy

from .conftest import CATALOGS

ALL = catalog.load([CATALOGS / "ALL.json"])


def test_name_words():
    assert cases.name_words("create_or_update_file") == "create or update file"
    assert cases.name_words("API-get-block-children") == "get block children"
    assert cases.name_words("getCurrentTime") == "get current time"


def test_derived_cases_are_short_imperatives_without_boilerplate():
    got = cases.derive(ALL.get("filesystem__read_file"))
    assert "read file" in got  # the name as words (the title "Read File (Deprecated)" is boilerplate)
    assert not any("DEPRECATED" in c or "allowed directories" in c for c in got)
    assert cases.derive(ALL.get("git__git_diff_unstaged"))[-1].startswith("show changes")
    notion = cases.derive(ALL.get("notion__API-update-a-block"))
    assert "update a block" in notion and not any("Error" in c or "|" in c for c in notion)


def test_use_lists_become_cases():
    got = cases.derive(ALL.get("atlassian__confluence_delete_attachment"))
    assert any(c.lower().startswith("remove outdated") for c in got)


def test_every_real_tool_gets_bounded_cases():
    for tool in ALL:
        got = cases.derive(tool)
        assert 1 <= len(got) <= cases.MAX_CASES, tool.name
        assert all(0 < len(c.split()) <= cases.MAX_WORDS + 8 for c in got), (tool.name, got)


def test_authored_cases_win():
    t = catalog.load([CATALOGS / "notes.json"]).get("create_note")
    assert cases.derive(t)[0] == "write a new document"


@pytest.mark.parametrize(
    "spec,first",
    [
        ("base", "write a new document"),
        ("prefix", "create_note: write a new document"),
        ("prefix+mcp", "MCP tool create_note: write a new document"),
        ("mcp", "MCP tool create_note: write a new document"),
    ],
)
def test_strategy_render(spec, first):
    t = catalog.load([CATALOGS / "notes.json"]).get("create_note")
    assert Strategy.parse(spec).render(t, cases.derive(t))[0] == first


def test_llm_and_action_add_texts():
    t = catalog.load([CATALOGS / "notes.json"]).get("create_note")
    c = cases.derive(t)
    llm = Strategy.parse("mcp+llm").render(t, c)
    assert "I should call create_note" in llm and "Let me use the create_note tool" in llm
    action = Strategy.parse("action").render(t, ["write a new document"])
    assert "save a new document" in action
    assert str(Strategy.parse("mcp + prefix")) == "prefix+mcp"
    with pytest.raises(ValueError, match="unknown strategy"):
        Strategy.parse("prefix+bogus")
