"""Catalog loading, merging and errors, on the real catalogs in fixtures/."""

import json

import pytest

from sidecar.core import catalog
from sidecar.core.catalog import CatalogError

from .conftest import CATALOGS


def test_single_file_keeps_names():
    c = catalog.load([CATALOGS / "filesystem.json"])
    assert "write_file" in c.names()
    assert c.get("write_file").server == "filesystem"


def test_merged_files_are_qualified_and_unique():
    c = catalog.load([CATALOGS / "github.json", CATALOGS / "gitlab.json"])
    assert c.get("github__create_issue") and c.get("gitlab__create_issue")
    assert c.get("gitlab__create_issue").bare_name == "create_issue"
    assert len(c) == 26 + 9


def test_all_json_is_already_qualified():
    c = catalog.load([CATALOGS / "ALL.json"])
    assert len(c) == 605
    t = c.get("filesystem__write_file")
    assert t.server == "filesystem" and t.bare_name == "write_file"


def test_definition_is_the_mcp_shape():
    t = catalog.load([CATALOGS / "filesystem.json"]).get("read_text_file")
    d = t.definition()
    assert d["name"] == "read_text_file" and d["inputSchema"]["required"] == ["path"]
    assert "cases" not in d and "server" not in d


def test_content_hash_tracks_what_the_index_uses():
    t = catalog.load([CATALOGS / "filesystem.json"]).get("read_text_file")
    import msgspec

    assert msgspec.structs.replace(t, annotations={"x": 1}).content_hash == t.content_hash
    assert msgspec.structs.replace(t, description="other").content_hash != t.content_hash


@pytest.mark.parametrize(
    "doc,message",
    [
        ({"nope": []}, 'expected an MCP tools/list result'),
        ({"tools": [{"description": "x"}]}, "tool '#0'"),
        ({"tools": [{"name": "a", "description": 3}]}, "tool 'a': Expected `str`, got `int` - at `description`"),
        ({"tools": [{"name": "a", "inputSchema": []}]}, "tool 'a'"),
        ({"tools": [{"name": "a", "cases": ["ok", " "]}]}, "tool 'a': \"cases\" holds an empty phrase"),
        ({"tools": [{"name": "a"}, {"name": "a"}]}, "tool 'a': name is not unique"),
    ],
)
def test_bad_catalogs_name_file_and_tool(tmp_path, doc, message):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(CatalogError) as e:
        catalog.load([f])
    assert str(e.value).startswith(str(f)) and message in str(e.value)


def test_unreadable_and_invalid_json(tmp_path):
    with pytest.raises(CatalogError, match="cannot read"):
        catalog.load([tmp_path / "missing.json"])
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(CatalogError, match="not valid JSON"):
        catalog.load([tmp_path / "x.json"])
    with pytest.raises(CatalogError, match="no catalog given"):
        catalog.load([])


# --- what many tools say: the index reads each description without it ----------------------

BFCL_MT = CATALOGS.parent / "transcripts" / "bfcl-multi-turn" / "catalog.json"


def test_a_servers_boilerplate_is_shared_and_left_out_of_what_the_index_reads():
    c = catalog.load([BFCL_MT])
    shared = catalog.shared_sentences(c)
    assert "This tool belongs to the Gorilla file system." in shared and "Tool description:" in shared
    read = catalog.distinct(c, shared)
    assert read.get("cat").description == "Display the contents of a file of any extension from currrent directory."
    assert c.get("cat").description.startswith("This tool belongs to the Gorilla file system.")  # the served tool keeps it
    assert [t.name for t in read] == c.names()
    assert all(a.description != b.description for a, b in zip(c, read))


def test_a_sentence_fewer_tools_say_a_wrapped_line_and_a_description_of_boilerplate_alone_stay():
    boiler = "Only works within allowed directories."
    tools = [
        {"name": "read", "description": f"Read a file.\nServer/Data Center\ninstances only. {boiler}"},
        {"name": "write", "description": f"Write a file.  Creates it if missing. {boiler}"},
        {"name": "move", "description": f"Move a file. {boiler}"},
        {"name": "guard", "description": boiler},
        {"name": "stat", "description": "Server/Data Center\nonly a stat. Not shared here."},
        {"name": "list", "description": "Server/Data Center\nlists. Not shared here."},
    ]
    c = catalog.from_tools(tools)
    shared = catalog.shared_sentences(c)
    assert boiler in shared and "Server/Data Center" not in shared  # a wrapped line's head is no sentence
    assert "Not shared here." not in shared  # two tools say it: below SHARED_BY
    read = catalog.distinct(c)
    assert read.get("read").description == "Read a file.\nServer/Data Center\ninstances only."
    assert read.get("write").description == "Write a file.  Creates it if missing."  # its spacing kept
    assert read.get("guard").description == boiler  # nothing of its own: kept whole
    assert read.get("stat") is c.get("stat")
    assert catalog.distinct(catalog.from_tools(tools[:2])).get("read").description == tools[0]["description"]
