"""The action views (sidecar/core/actions.py): what a text asks for and what a tool does, and the
ranking on the real models with the built-in calibrations, whose fitted weights move a
request's verb past a shared noun."""

from __future__ import annotations

import numpy as np
import pytest

from sidecar.core import actions, calibration, models
from sidecar.core import catalog as catalog_mod
from sidecar import config as config_mod
from sidecar.learn import learned
from sidecar.core import pipeline
from sidecar.core.catalog import Tool
from sidecar.store import open_store
from tests.conftest import CATALOGS

FILE_SERVERS = [CATALOGS / f"{c}.json" for c in ("filesystem", "git", "github", "notes")]


@pytest.mark.parametrize(("text", "classes"), [
    ("please write the summary into a file called out.md", {"create"}),
    ("can you open config.toml", {"read"}),
    ("Saving the report to disk now.", {"create"}),  # a reply's -ing form
    ("Setting the reminder for Friday.", {"update"}),  # doubled consonant
    ("get rid of the old branch", {"delete"}),  # a two-word verb
    ("open a ticket for the login bug", {"create"}),  # opening a new thing makes it
    ("Before moving it, I'll check which folders exist.", {"read"}),  # the scene-setting clause is skipped
    ("hey, delete the old draft", {"delete"}),
    ("stage the changes in app.py", {"stage"}),
    ("Find the old report. Then delete it.", {"search", "delete"}),  # two steps, both asked
    ("calculate the total of these invoices", {"compute"}),  # computing tells, it changes nothing
    ("comment on the PR: looks good", {"create"}),  # everyday verbs the first taxonomy lacked
    ("tag the invoice as paid", {"update"}),
    ("nuke the cache key", {"delete"}),
    ("forget what I said about Alice", {"delete"}),
    ("pause the nightly job", {"stop"}),
    ("crawl the docs site", {"read"}),
    ("take down the old post", {"delete"}),  # a two-word verb whose first word is no taxonomy verb
    ("kick off ./deploy.sh in a terminal", {"run"}),
])  # fmt: skip
def test_the_leading_verb_names_the_action(text, classes):
    assert actions.of_text(text).classes == classes


@pytest.mark.parametrize("text", ["my list of groceries is long", "the search is slow today", "email from Bob about lunch", "thanks!",
                                  "thanks for saving it", "the take down notice came in"])
def test_a_verb_used_as_a_noun_names_none(text):
    assert actions.of_text(text) == actions.Action()


@pytest.mark.parametrize("text", ["what did I change in the parser yesterday?", "how's the crawl going?", "how big is notes.txt?",
                                  "any new comments on the PR?"])
def test_a_question_retrieves_without_saying_how(text):
    a = actions.of_text(text)
    assert a.families == {"retrieve"} and not a.classes


@pytest.mark.parametrize(("name", "description", "classes"), [
    ("read_text_file", "Read the complete contents of a file as text.", {"read"}),
    ("write_file", "Create a new file or completely overwrite an existing file.", {"create"}),
    ("git_add", "Adds file contents to the staging area", {"create", "stage"}),
    ("git_reset", "Unstages all staged changes", {"unstage"}),
    ("read_email", "Retrieves the content of a specific email", {"read"}),  # "email" is the object here
    ("create_or_update_file", "Create or update a single file", {"create", "update"}),
    ("get_tasks", "Get tasks with optional pagination.", {"read", "list"}),  # getting a plural lists
    ("start_search", "Search for files by name, streaming the results.", {"search"}),  # "start" says how
])  # fmt: skip
def test_a_tool_does_what_its_name_and_description_lead_with(name, description, classes):
    assert actions.of_tool(Tool(name=name, description=description)).classes == classes


def test_views_mark_a_shared_action_and_a_clash_of_families():
    tools = [Tool(name="read_file", description="Read a file."), Tool(name="write_file", description="Write a file."),
             Tool(name="move_file", description="Move a file."), Tool(name="frobnicate", description="Frobnicates.")]  # fmt: skip
    v = actions.ActionIndex(tools).views(["save this as a.txt", "thanks", "what is in a.txt?"])
    assert v.shape == (3, 4, 2)
    assert v[0, :, 0].tolist() == [0, 1, 0, 0]  # save and write create
    assert v[0, :, 1].tolist() == [1, 0, 0, 0]  # saving is no retrieval; moving writes too; an unknown tool clashes with nothing
    assert not v[1].any()  # no action asked, no view
    assert v[2, :, 1].tolist() == [0, 1, 1, 0]  # a question retrieves


def test_a_calibration_fitted_before_the_action_views_gives_them_no_weight():
    old = learned.Ranker((1.0, 0.1, 0.3, 0.0))
    f = np.random.default_rng(0).normal(size=(2, 5, len(learned.RANK_FEATURES))).astype(np.float32)
    assert np.allclose(old.score(f), f[..., :4] @ np.asarray(old.weights, np.float32))
    for model in (models.DEFAULT_MODEL, models.SMALL_MODEL):  # the built-ins have them, fitted: a shared action up, a clash down
        w = dict(zip(learned.RANK_FEATURES, calibration.builtin(model).ranker.weights))
        assert w["action"] > 0 > w["clash"]


def test_fitting_added_views_holds_the_others():
    rng = np.random.default_rng(1)
    f = rng.normal(size=(60, 6, 3))
    targets = [[int(np.argmax(r[:, 2]))] for r in f]  # the third view says the answer
    w = learned.RankerFit().weights(f, targets, fixed=(0.5, 0.0))
    assert w[:2] == (0.5, 0.0) and w[2] > 0.5


@pytest.fixture(scope="module", params=[models.DEFAULT_MODEL, models.SMALL_MODEL])
def files(request, tmp_path_factory) -> pipeline.Pipeline:
    """The views on descriptions alone: the shipped case packs (on by default) cover these
    servers and would move the rankings these tests pin on the views (tests/test_casebook.py)."""
    cfg = config_mod.load(env={}, overrides={("model", "name"): request.param, ("catalogs",): [str(c) for c in FILE_SERVERS], ("cases", "fill"): False})
    return pipeline.from_config(cfg, store=open_store(tmp_path_factory.mktemp("store") / "sidecar.db"), progress=False)


def test_writing_to_a_file_ranks_no_read_tool_first(files):
    """Measured before the action views: MiniLM ranked `list_allowed_directories` first, nomic
    `read_text_file` (the request names a file; what it asks is to write one)."""
    first = files.rank_batch([pipeline.Request("record these numbers in totals.csv")], k=3)[0]
    assert first[0].tool in ("filesystem__write_file", "filesystem__edit_file"), first


def test_the_action_views_move_the_asked_action_up(files):
    """The same texts ranked with the action views' weights set to 0 and as fitted: the tool
    that does what is asked gains, a tool of another family loses."""
    texts = ["record these numbers in totals.csv", "unstage src/app.py"]
    want = ["filesystem__write_file", "git__git_reset"]
    other = ["filesystem__read_text_file", "git__git_diff_unstaged"]
    ranked = files.rank_batch([pipeline.Request(t) for t in texts], k=len(files.catalog))
    saved = files.ranker
    try:
        files.ranker = learned.Ranker((*saved.weights[:4], 0.0, 0.0, *saved.weights[6:]), saved.adapter)
        plain = files.rank_batch([pipeline.Request(t) for t in texts], k=len(files.catalog))
    finally:
        files.ranker = saved
    for r, p, w, o in zip(ranked, plain, want, other):
        pos, before = [c.tool for c in r], [c.tool for c in p]
        assert pos.index(w) <= before.index(w) and pos.index(o) >= before.index(o)
        assert pos.index(w) < pos.index(o)


def test_a_catalogs_own_cases_take_their_tools_action():
    """What the self-fit fits the action views on: each case against the catalog's tools."""
    cat = catalog_mod.from_tools([
        {"name": "save_file", "description": "Save text to a file.", "cases": ["save this to a file", "write the text to disk", "store it as a file"]},
        {"name": "read_file", "description": "Read a file.", "cases": ["read the file", "open the file", "show me the file"]},
        {"name": "delete_file", "description": "Delete a file.", "cases": ["delete the file", "remove that file", "erase the file"]},
    ])  # fmt: skip
    v = actions.ActionIndex(list(cat)).views([c for t in cat for c in t.cases])
    assert v[:, :, 0].argmax(axis=1).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
