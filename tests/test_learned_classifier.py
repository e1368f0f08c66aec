"""The ranker's classifier view: a softmax over the tools fitted on a catalog's own cases, on
the real small model and a real SQLite store; absent for catalogs without own cases; and
calibrations written before it (three ranker weights, eleven gate scalars) still load."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from sidecar.core import calibration, models, pipeline
from sidecar.learn import learned
from sidecar.core.gate import route
from sidecar import config as config_mod
from sidecar.core.pipeline import Request
from sidecar.store import open_store
from tests.conftest import CATALOGS

INTENTS = {
    "check_balance": ["what is my balance", "how much money do I have", "show my account balance",
                      "tell me my current balance", "how much is in my checking account", "balance please"],
    "lost_card": ["I lost my card", "my card was stolen", "I can't find my debit card",
                  "someone took my credit card", "report a missing card", "my wallet with my card is gone"],
    "change_pin": ["change my PIN", "I want a new PIN code", "how do I reset my PIN",
                   "update the PIN on my card", "set a different PIN", "my PIN needs changing"],
    "exchange_rate": ["what is the euro to dollar rate", "exchange rate for yen", "how many pounds for 100 dollars",
                      "currency conversion rate today", "what rate do you give for francs", "dollar to peso rate"],
    "transfer_money": ["send money to my brother", "transfer 50 dollars to savings", "wire funds to another bank",
                       "move money between my accounts", "pay my friend back 20 euros", "make a bank transfer"],
}  # fmt: skip
HELD_BACK = [  # paraphrases that are none of the cases
    ("how much cash is left on my account?", "check_balance"),
    ("my bank card has disappeared", "lost_card"),
    ("can I choose another PIN for my debit card", "change_pin"),
    ("what's the conversion from euros into dollars", "exchange_rate"),
    ("please send 30 pounds to my mum", "transfer_money"),
]


def _pipeline(tmp_path, catalog_path) -> pipeline.Pipeline:
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(catalog_path)]})
    return pipeline.from_config(cfg, store=open_store(tmp_path / "sidecar.db"), progress=False)


@pytest.fixture(scope="module")
def intents(tmp_path_factory) -> pipeline.Pipeline:
    d = tmp_path_factory.mktemp("intents")
    tools = [{"name": n, "description": n.replace("_", " "), "inputSchema": {"type": "object"}, "cases": c} for n, c in INTENTS.items()]
    (d / "bank.json").write_text(json.dumps({"server": "bank", "tools": tools}))
    return _pipeline(d, d / "bank.json")


def test_a_catalog_with_own_cases_gets_a_classifier_that_ranks_held_back_paraphrases(intents):
    index = intents.index_for("user")
    assert index.classifier is not None and index.classifier.coef.shape == (index.dim, len(INTENTS))
    requests = [Request(t) for t, _ in HELD_BACK]
    vectors = intents.embedder.embed([t for t, _ in HELD_BACK], "query").vectors
    views = intents.views(requests, vectors)
    for (_, want), v in zip(HELD_BACK, views):
        assert v.logits is not None
        assert index.names[int(np.argmax(v.logits[0]))] == want
        lp = learned.classifier_view(v.logits, v.cosine.shape)
        assert lp.max() <= 0 and np.exp(lp).sum() == pytest.approx(1.0, abs=1e-3)  # log-probabilities over the tools
    # what the gate head sees: the classifier's max probability, one scalar among the others
    routes = [route(r.text, r.source, intents.patterns) for r in requests]
    x = intents.gate_inputs(requests, vectors, views, routes, None, names=learned.GATE_SCALARS)
    clf = x[:, learned.GATE_SCALARS.index("classifier_top1")]
    assert np.all(clf > 1 / len(INTENTS))


def test_a_fitted_classifier_is_kept_in_the_store_and_read_back_as_it_was(intents, tmp_path, capsys):
    """A fit takes seconds on a large catalog (every `detect` on one did it again, and `serve`
    once a start): the store keeps it by what decides it, so a new process reads it back, the
    same weights; a store that never saw the catalog fits again, and so does another set of
    rows (the tools changed)."""
    from sidecar.core import index as index_mod

    index = intents.index_for("user")
    model = intents.embedder.identity
    fitted = index.classifier
    store = open_store(tmp_path / "fits.db")
    index_mod._classifiers.clear()  # a new process: nothing memoised
    first = index_mod.classifier_for(index, model, progress=True, store=store, scheme="s")
    assert "fitting the classifier" in capsys.readouterr().err
    np.testing.assert_allclose(first.coef, fitted.coef, atol=1e-6)
    index_mod._classifiers.clear()
    again = index_mod.classifier_for(index, model, progress=True, store=store, scheme="s")
    assert capsys.readouterr().err == ""  # read back, not fitted
    assert np.array_equal(again.coef, first.coef) and np.array_equal(again.bias, first.bias)
    index_mod._classifiers.clear()
    index_mod.classifier_for(index, model, progress=True, store=store, scheme="another scheme")
    assert "fitting the classifier" in capsys.readouterr().err  # other rows: fitted again
    assert len(store.query("SELECT key FROM classifier_fits")) == 2


def test_a_catalog_without_own_cases_gets_no_classifier_and_a_zero_view(tmp_path):
    pipe = _pipeline(tmp_path, CATALOGS / "notes.json")
    assert pipe.index_for("user").classifier is None
    vectors = pipe.embedder.embed(["take a note about the meeting"], "query").vectors
    (v,) = pipe.views([Request("take a note about the meeting")], vectors)
    assert v.logits is None
    features = learned.rank_features(v.cosine, v.bm25, v.cases, v.logits)
    assert features.shape[-1] == len(learned.RANK_FEATURES) and not features[..., 3].any()


def test_a_calibration_from_before_the_classifier_still_loads_and_scores_the_same():
    """A ranker written before the classifier view and the query adapter: three weights."""
    old = msgspec.json.decode(b'{"weights": [0.48049, 0.16942, 0.32674]}', type=learned.Ranker)
    assert old.adapter is None
    rng = np.random.default_rng(1)
    f = rng.normal(size=(4, 7, len(learned.RANK_FEATURES))).astype(np.float32)
    assert np.allclose(old.score(f), f[..., :3] @ np.asarray(old.weights, np.float32))
    doc = json.loads(msgspec.json.encode(old))
    assert msgspec.json.decode(json.dumps(doc), type=learned.Ranker) == old
    with pytest.raises(msgspec.ValidationError, match="weights"):
        msgspec.json.decode(json.dumps({"weights": [1] + [0] * len(learned.RANK_FEATURES)}), type=learned.Ranker)
    builtin = calibration.builtin(models.SMALL_MODEL)  # refitted since: a weight per view (the action and argument views'), twelve scalars, an adapter
    assert len(builtin.ranker.weights) == len(learned.RANK_FEATURES) and "classifier_top1" in builtin.head.features and builtin.ranker.adapter is not None


def test_fit_classifier_separates_clusters_with_standardisation_folded_in():
    rng = np.random.default_rng(0)
    tools, per, dim = 6, 20, 16
    centres = rng.normal(size=(tools, dim))
    labels = np.repeat(np.arange(tools), per)
    x = centres[labels] + 0.6 * rng.normal(size=(tools * per, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    clf = learned.ClassifierFit(iters=200).fit(x, labels, tools)
    test = centres + 0.6 * rng.normal(size=(tools, dim))
    test /= np.linalg.norm(test, axis=1, keepdims=True)
    assert (clf.logits(test).argmax(axis=1) == np.arange(tools)).mean() >= 5 / 6
    assert (clf.logits(x).argmax(axis=1) == labels).mean() > 0.95


EXAMPLES = [  # labelled requests a user tunes on, phrased unlike the cases
    ("what's left in my wallet account right now", "check_balance"), ("am I in the red this month", "check_balance"),
    ("my visa got nicked on the train", "lost_card"), ("the atm swallowed my card", "lost_card"),
    ("four new digits for my card please", "change_pin"), ("forgot the code for my card, want a fresh one", "change_pin"),
    ("how many rupees will 200 dollars buy me", "exchange_rate"), ("is the pound strong against the euro today", "exchange_rate"),
    ("pay the landlord 900 from checking", "transfer_money"), ("split the dinner bill with Sam, send him 35", "transfer_money"),
]  # fmt: skip
TALK = ["thanks, that's all", "good morning", "what a lovely day", "tell me a joke", "how do banks make money in general?",
        "I love this song", "nice, that works", "why is the sky blue"]  # fmt: skip


def test_tune_keeps_its_requests_as_examples_that_the_classifier_learns_from(intents, tmp_path):
    """Tool2Vec's idea on an intent catalog: the requests `tune` fitted on are kept in the
    calibration (one tool each), and a pipeline that loads it fits its classifier on them as
    well as on the tools' own cases: each example's own intent becomes likelier."""
    from sidecar.lab import tune
    from sidecar.lab.evaluate import Labeled

    bank = tmp_path / "bank.json"
    bank.write_text(json.dumps({"server": "bank", "tools": [{"name": n, "description": n.replace("_", " "),
                                                              "inputSchema": {"type": "object"}, "cases": c} for n, c in INTENTS.items()]}))  # fmt: skip
    items = [Labeled(t, e) for t, e in EXAMPLES] + [Labeled(t, None) for t in TALK]
    cfg = config_mod.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(bank)], ("store",): str(tmp_path / "s.db")})
    fitted = tune.fit(items, intents.catalog, cfg, heldout_fraction=0.0, start="none")
    ex = fitted.calibration.examples
    assert ex is not None and ex.tools == [e for _, e in EXAMPLES]
    vectors, at = ex.rows_for(intents.index_for("user").names)
    assert len(vectors) == len(EXAMPLES) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-2)
    cal = tmp_path / "cal.json"
    tune.write_calibration(fitted, cal)
    assert calibration.read(cal).examples == ex
    overrides = {("model", "name"): models.SMALL_MODEL, ("catalogs",): [str(bank)], ("calibration",): str(cal)}
    tuned = pipeline.from_config(config_mod.load(env={}, overrides=overrides), store=open_store(tmp_path / "s.db"), progress=False)
    before, after = intents.index_for("user").classifier, tuned.index_for("user").classifier
    assert after is not None and not np.allclose(before.coef, after.coef)
    own = lambda clf: learned.classifier_view(clf.logits(vectors), (len(vectors), len(INTENTS)))[np.arange(len(vectors)), at]  # noqa: E731
    assert np.all(own(after) > own(before))


def test_a_catalog_without_own_cases_keeps_no_examples(tmp_path):
    from sidecar.lab import tune

    pipe = _pipeline(tmp_path, CATALOGS / "notes.json")
    assert tune._examples([], np.zeros((0, pipe.embedder.dim)), pipe.catalog) is None
    assert calibration.builtin(models.SMALL_MODEL).examples is None  # the corpus's catalog derives its cases
