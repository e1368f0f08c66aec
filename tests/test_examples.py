"""The page's examples (sidecar/serve/examples.py) on the real fixture catalogs: no model needed."""

from __future__ import annotations

from sidecar.core import catalog as catalog_mod
from sidecar.serve.examples import MAX_EXAMPLES, examples

from .conftest import CATALOGS


def test_a_merged_catalogs_examples_are_spread_over_its_servers():
    catalog = catalog_mod.load([CATALOGS / "ALL.json"])
    ex = examples(catalog)
    servers = [catalog.get(name).server for name in ex.tools]
    assert len(ex.tools) == len(ex.user) == len(ex.reply) == MAX_EXAMPLES
    assert len(set(servers)) == MAX_EXAMPLES and None not in servers  # one tool per server
    for name, reply in zip(ex.tools, ex.reply):
        assert reply.startswith(f"Sure. I should call {name} to ")


def test_a_tools_own_cases_are_its_user_turn():
    catalog = catalog_mod.load([CATALOGS / "notes.json"])
    ex = examples(catalog, n=3)
    tools = [catalog.get(name) for name in ex.tools]
    assert [t.name for t in tools] == catalog.names()[:3]  # one server: catalog order
    assert ex.user == [t.cases[0][:1].upper() + t.cases[0][1:] for t in tools]


def test_an_empty_catalog_has_no_examples():
    assert examples(catalog_mod.Catalog([])) == examples(catalog_mod.Catalog([]), n=0)
    assert examples(catalog_mod.Catalog([])).user == []
