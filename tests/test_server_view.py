"""The server view (learned.server_view): how well a tool's server as a whole matches a text,
beside how well the tool does, so a lone tool of another server that shares a word with the
text stands below the tools of the server the text is about."""

from __future__ import annotations

import numpy as np

from sidecar.core import calibration, models, pipeline
from sidecar import config as config_mod
from sidecar.learn import learned
from sidecar.store import open_store
from tests.test_actions import FILE_SERVERS, files  # noqa: F401  (the four file servers' pipeline, per model)


def test_a_tool_gets_its_servers_mean_cosine_less_the_best_servers():
    cosine = np.array([[0.9, 0.1, 0.5, 0.5, 0.5]], np.float32)  # tools 0-1: server a, 2-4: server b
    view = learned.server_view(cosine, learned.server_ids(["a", "a", "b", "b", "b"]))
    assert np.allclose(view, [[0.0, 0.0, 0.0, 0.0, 0.0]])  # a and b both average 0.5
    cosine = np.array([[0.9, 0.1, 0.6, 0.6, 0.6], [0.2, 0.2, 0.1, 0.1, 0.4]], np.float32)
    view = learned.server_view(cosine, learned.server_ids(["a", "a", "b", "b", "b"]))
    assert np.allclose(view, [[-0.1, -0.1, 0.0, 0.0, 0.0], [0.0, 0.0, -0.0, -0.0, -0.0]])
    assert not learned.server_view(cosine, learned.server_ids([None] * 5)).any()  # one server (or none named): no view
    assert not learned.server_view(cosine, None).any()
    features = learned.rank_features(cosine, np.ones_like(cosine), cosine, servers=learned.server_ids(["a", "a", "b", "b", "b"]))
    assert features.shape[-1] == len(learned.RANK_FEATURES) and np.allclose(features[..., learned.RANK_FEATURES.index("server")], view)


def test_the_builtin_calibrations_weigh_the_view():
    for model in (models.DEFAULT_MODEL, models.SMALL_MODEL):
        weights = calibration.builtin(model).ranker.weights
        assert len(weights) == len(learned.RANK_FEATURES) and weights[learned.RANK_FEATURES.index("server")] > 0.1


def test_the_pipeline_groups_tools_by_their_server(files, tmp_path):  # noqa: F811
    """Real model, real catalogs: among four servers the view is each server's mean cosine
    to the text, less the best's (0 for the best server's tools); over one server, 0."""
    text = "what changed in the last commit of this repo?"
    q = files.queries.embed(files.embedder, [text]).vectors
    v = files.views([pipeline.Request(text)], q)[0]
    column = learned.RANK_FEATURES.index("server")
    servers = np.array([t.server for t in files.catalog])
    means = {s: float(v.cosine[0, servers == s].mean()) for s in set(servers)}
    best = max(means, key=means.get)
    assert best == "git", means
    for s, mean in means.items():
        assert np.allclose(v.features[servers == s, column], mean - means[best], atol=1e-5)
    cfg = config_mod.load(env={}, overrides={("model", "name"): files.embedder.name, ("catalogs",): [str(FILE_SERVERS[0])]})
    one = pipeline.from_config(cfg, store=open_store(tmp_path / "sidecar.db"), progress=False, embedder=files.embedder)
    assert not one.views([pipeline.Request(text)], q)[0].features[:, column].any()
