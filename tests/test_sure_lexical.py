"""The sure-lexical view (learned.sure_lexical): a text whose words repeat a tool's own
phrases (a high BM25 score, not only the best of a weak lot) leans on BM25 more."""

from __future__ import annotations

import numpy as np

from sidecar.core import calibration, models, pipeline
from sidecar.learn import learned
from tests.test_actions import FILE_SERVERS, files  # noqa: F401  (the four file servers' pipeline, per model)

COLUMN = learned.RANK_FEATURES.index("sure_lexical")


def test_the_view_is_the_lexical_view_scaled_past_the_knot():
    cosine = np.zeros((3, 3), np.float32)
    knot = learned.SURE_LEXICAL_FROM
    bm25 = np.array([[knot - 1, 2.0, 0.0], [knot + 5, (knot + 5) / 2, 0.0], [knot + 20, 0.0, knot + 10]], np.float32)
    features = learned.rank_features(cosine, bm25, cosine)
    assert features.shape[-1] == len(learned.RANK_FEATURES)
    assert not features[0, :, COLUMN].any()  # best score under the knot: nothing
    assert np.allclose(features[1, :, COLUMN], [0.5, 0.25, 0.0])  # 5 past it: half the lexical view
    assert np.allclose(features[2, :, COLUMN], [2.0, 0.0, 2.0 * (knot + 10) / (knot + 20)])
    assert not learned.rank_features(np.zeros((1, 0)), np.zeros((1, 0)), np.zeros((1, 0))).size  # no tools


def test_the_builtin_calibrations_weigh_the_view_and_tuning_holds_it():
    for model in (models.DEFAULT_MODEL, models.SMALL_MODEL):
        ranker = calibration.builtin(model).ranker
        assert len(ranker.weights) == len(learned.RANK_FEATURES) and ranker.weights[COLUMN] > 0.03
        assert learned.held_views(ranker, len(learned.RANK_FEATURES))[COLUMN] == ranker.weights[COLUMN]


def test_the_pipeline_scales_a_text_by_its_own_best_bm25(files):  # noqa: F811
    """Real model, real catalogs: a text that repeats a tool's description gets the view on
    that tool, a short request gets none, and the view is what the ranker adds to the blend."""
    tool = next(t for t in files.catalog if t.name == "filesystem__search_files")
    texts = [tool.description + " " + tool.description, "open notes.txt"]
    q = files.queries.embed(files.embedder, texts).vectors
    long, short = files.views([pipeline.Request(t) for t in texts], q)
    top = float(long.bm25.max())
    assert top > learned.SURE_LEXICAL_FROM, top
    expected = long.bm25[0] / top * (top - learned.SURE_LEXICAL_FROM) / 10.0
    assert np.allclose(long.features[:, COLUMN], expected, atol=1e-5)
    assert int(np.argmax(long.features[:, COLUMN])) == [t.name for t in files.catalog].index(tool.name)
    assert float(short.bm25.max()) < learned.SURE_LEXICAL_FROM and not short.features[:, COLUMN].any()
    weight = files.ranker.weights[COLUMN]
    without = np.array(long.features[:, : len(learned.RANK_FEATURES)])
    without[:, COLUMN] = 0.0
    assert np.allclose(long.scores.ravel() - files.ranker.score(without[None])[0], weight * long.features[:, COLUMN], atol=1e-4)
