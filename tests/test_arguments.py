"""The argument view (sidecar/core/arguments.py): the kinds of thing a text names, what a tool's
input schema takes, and the ranking on the real models with the built-in calibrations, whose
fitted weight moves a request toward the tools that take what it names."""

from __future__ import annotations

import time

import pytest

from sidecar.core import arguments, calibration, models, pipeline
from sidecar.learn import learned
from sidecar.core.catalog import Tool
from tests.test_actions import files  # noqa: F401  (the four file servers' pipeline, per model)


@pytest.mark.parametrize(("text", "kinds"), [
    ("open notes.txt", {"file"}),
    ("whats in the .env file", {"file"}),
    ("read posts/draft.md back to me", {"file"}),
    ("ls /etc and ~/projects", {"folder"}),
    ("make a folder called src/utils", {"slug"}),  # a folder, a repository or a branch
    ("fork acme/webapp to my account", {"slug"}),
    ("send it to ana@example.com.", {"email"}),
    ("fetch https://example.com/a?b=c", {"url"}),
    ("whats in commit 3f2a9e1", {"commit"}),
    ("move the dentist to friday at 10", set()),  # times: dropped (the module's docstring)
    ("accelerate to 4 m/s for 30 km/h", set()),  # units, not folders
    ("from Boston to Washington D.C.", set()),  # D.C. is no C source file
    ("this and/or that, thanks", set()),
    ("version 1.2.3 is out", set()),
    ("tell me a joke", set()),
])  # fmt: skip
def test_a_text_names_kinds_token_by_token(text, kinds):
    assert arguments.of_text(text) == kinds


@pytest.mark.parametrize(("name", "schema", "kinds"), [
    ("path", {"type": "string"}, {"file", "folder", "slug"}),
    ("repo_path", {"type": "string"}, {"folder", "slug"}),  # a repository's folder, never a file
    ("owner", {"type": "string"}, {"slug"}),
    ("workdir", {"type": "string", "description": "Working directory"}, {"folder", "slug"}),
    ("timeMin", {"type": "string", "description": "Start of time range (ISO 8601)", "format": "date-time"}, set()),
    ("to", {"type": "array", "description": "List of recipient email addresses"}, {"email"}),
    ("contact", {"type": "string", "format": "email"}, {"email"}),
    ("homepage", {"type": "string", "format": "uri"}, {"url"}),
    ("revision", {"type": "string"}, {"commit"}),
    ("title", {"type": "string"}, set()),
])  # fmt: skip
def test_a_property_takes_kinds_by_name_format_and_description(name, schema, kinds):
    assert arguments.of_property(name, schema) == kinds


def test_a_kind_only_optional_properties_take_counts_half():
    draft = Tool(name="draft_email", inputSchema={"type": "object", "required": ["to"], "properties": {
        "to": {"type": "string", "format": "email"}, "attachments": {"type": "array", "items": {"type": "string"}}}})  # fmt: skip
    batch = Tool(name="read_files", inputSchema={"type": "object", "properties": {
        "files": {"type": "array", "items": {"type": "object", "properties": {"url": {"type": "string"}}}}}})  # fmt: skip
    assert arguments.of_tool(draft) == {"email": 1.0, "file": arguments.OPTIONAL}
    assert arguments.of_tool(batch) == {"file": 1.0, "url": 1.0}  # one level into an array's items
    assert arguments.of_tool(Tool(name="no_schema")) == {}


def test_the_view_is_the_share_of_named_kinds_a_tool_takes():
    tools = [Tool(name="read_file", inputSchema={"properties": {"path": {"type": "string"}}}),
             Tool(name="fetch", inputSchema={"properties": {"url": {"type": "string"}}}),
             Tool(name="read_note", inputSchema={"properties": {"id": {"type": "string"}}})]  # fmt: skip
    v = arguments.ArgumentIndex(tools).views(["open notes.txt", "post notes.txt to https://paste.example", "thanks"])
    assert v.shape == (3, 3, 1)
    assert v[0, :, 0].tolist() == [1, 0, 0]
    assert v[1, :, 0].tolist() == [0.5, 0.5, 0]  # two kinds named, each tool takes one
    assert not v[2].any()  # nothing named, no view


def test_scanning_is_linear_in_what_a_client_sends():
    """Every token is matched whole by an anchored pattern, and long ones are skipped:
    1 MB of adversarial text takes about as long per byte as 100 KB."""

    def seconds(n: int) -> float:
        text = " ".join(["a" * 150 + "." * 40, "a/" * 90 + "b", "1" * 199 + "@", "(" * 199] * n)
        start = time.perf_counter()
        arguments.of_text(text)
        return time.perf_counter() - start

    small, big = seconds(150), seconds(1500)
    assert big < 30 * small + 0.05


def test_the_builtin_calibrations_weigh_the_view():
    for model in (models.DEFAULT_MODEL, models.SMALL_MODEL):
        weights = calibration.builtin(model).ranker.weights
        assert len(weights) == len(learned.RANK_FEATURES) and weights[learned.RANK_FEATURES.index("argument")] > 0.05


def test_a_named_file_outranks_a_shared_noun(files):  # noqa: F811
    """"open notes.txt" names a file: a filesystem reader comes before the notes server's
    `read_note`, whose words agree more (nomic put `read_note` first of both before the view);
    with the view's weight at 0, `read_note` stands higher."""
    texts = ["open notes.txt", "read me todo.md"]
    requests = [pipeline.Request(t) for t in texts]
    column = files.index_for("user").names.index
    views = files.views(requests, files.queries.embed(files.embedder, texts).vectors)
    assert views[0].symbolic[0, column("filesystem__read_text_file"), 2] == 1 and views[0].symbolic[0, column("notes__read_note"), 2] == 0
    ranked = files.rank_batch(requests, k=len(files.catalog))
    saved = files.ranker
    try:
        files.ranker = learned.Ranker(saved.weights[:6], saved.adapter)
        plain = files.rank_batch(requests, k=len(files.catalog))
    finally:
        files.ranker = saved
    for text, r, p in zip(texts, ranked, plain):
        assert r[0].tool.startswith("filesystem__read"), (text, r[:3])
        before, after = [c.tool for c in p], [c.tool for c in r]
        assert after.index("notes__read_note") > before.index("notes__read_note")
