"""The arithmetic of evaluation and tuning, on hand-made scores (no model needed)."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from sidecar.core import gate
from sidecar.learn import learned
from sidecar.lab import evaluate, tune
from sidecar.core.catalog import load as load_catalog
from sidecar.lab.evaluate import Labeled
from sidecar.core.gate import Thresholds
from tests.conftest import CATALOGS


def test_auroc_matches_pair_counting():
    rng = np.random.default_rng(1)
    pos = np.round(rng.normal(0.6, 0.1, 40), 2)
    neg = np.round(rng.normal(0.4, 0.1, 50), 2)
    pairs = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    assert evaluate.auroc(pos, neg) == pytest.approx(pairs)
    assert evaluate.auroc([1, 2], [0, 0.5]) == 1.0
    assert evaluate.auroc([0.5], [0.5]) == 0.5
    assert math.isnan(evaluate.auroc([], [1.0]))


def test_ranking_report_by_hand():
    items = [Labeled("a", "x"), Labeled("b", ["y", "z"]), Labeled("c", "w"), Labeled("d", None)]
    rankings = [["x", "q"], ["q", "z", "y"], ["q", "r", "s", "t"], ["x"]]
    r = evaluate.ranking_report(items, rankings)
    assert r.n == 3
    assert r.top1 == pytest.approx(1 / 3)
    assert r.top3 == pytest.approx(2 / 3)
    assert r.mrr == pytest.approx((1 + 1 / 2 + 0) / 3)
    ideal_b = 1 + 1 / math.log2(3)
    assert r.ndcg_at_10 == pytest.approx((1 + (1 / math.log2(3) + 1 / math.log2(4)) / ideal_b + 0) / 3)
    assert r.coverage == pytest.approx(1 / 4)  # x of {x, y, z, w}


def test_read_labeled_reports_file_and_line(tmp_path):
    cat = load_catalog([CATALOGS / "notes.json"])
    good = tmp_path / "ok.jsonl"
    good.write_text('{"text": "take a note", "expect": "create_note"}\n\n{"text": "hi", "expect": null, "source": "llm"}\n')
    items = evaluate.read_labeled(good, cat)
    assert [i.positive for i in items] == [True, False] and items[1].source == "llm"
    for body, needle in [
        ('{"text": "x", "expect": "nope"}', ":1: expected tool(s) not in the catalog: nope"),
        ('{"text": "x"}\n{"text": 3}', ":2: Expected `str`"),
        ('{"text": "x", "source": "bot"}', ":1:"),
        ('{"text": "x", "expect": []}', ":1: expect is an empty list"),
        ("not json", ":1:"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(evaluate.LabeledError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            evaluate.read_labeled(bad, cat)


def _scores(seed=0, n=200):
    """Positives score higher, more so on the high-pattern path; a few blocked items."""
    rng = np.random.default_rng(seed)
    path, score, positive, correct = [], [], [], []
    for i in range(n):
        pos = i % 2 == 0
        kind = rng.choice(["high", "fallback", "negative"], p=[0.4, 0.55, 0.05])
        base = (0.62 if pos else 0.42) + (0.05 if kind == "high" else 0.0)
        path.append(str(kind))
        score.append(float(rng.normal(base, 0.07)))
        positive.append(pos)
        correct.append(pos and rng.random() < 0.85)
    return tune.GateScores(path, score, positive, correct)


def test_tune_counts_exactly_what_the_gate_fires():
    """tune searches thresholds with the gate's own rule: for every item, what `fired` counts
    is what `gate.decide` decides, per-tool thresholds included."""
    s = _scores(seed=5)
    s.tool = [("t1" if k % 3 == 0 else "t2") for k in range(len(s.path))]
    t = Thresholds(high=0.5, fallback=0.6, auto=0.7, confirm=0.45, tools={"t1": gate.ToolThresholds(fallback=0.47)})
    counted = tune.fired(s, t)
    routes = {"high": gate.Route("high:x"), "fallback": gate.Route("fallback"), "negative": gate.Route("negative:x")}
    judged = [gate.decide("x", "user", routes[k], [gate.Candidate(tool, sc, "c")], t, gate.Timing()).fired
              for k, sc, tool in zip(s.path, s.score, s.tool)]  # fmt: skip
    assert counted.tolist() == judged
    assert 0 < sum(judged) < len(judged) and any(f and k == "fallback" and tl == "t1" and sc < 0.6 for f, k, tl, sc in zip(judged, s.path, s.tool, s.score))


def test_fit_gate_refuses_too_little_data():
    s = _scores(n=10)
    with pytest.raises(ValueError, match="at least"):
        tune.fit_gate(s)


def test_objective_parse():
    assert tune.Objective.parse("max_tp") == tune.Objective("max_tp", 0.05)
    assert tune.Objective.parse("max_tp:fp<=0.02").max_fp == 0.02
    assert tune.Objective.parse("balanced").kind == "balanced"
    for bad in ("max_fp", "max_tp:fp<=2", "balanced:x"):
        with pytest.raises(ValueError, match="unknown objective"):
            tune.Objective.parse(bad)


def test_f1_objective_weighs_the_mix_of_positives():
    f1 = tune.Objective.parse("f1")
    assert str(f1) == "f1"
    tp, fp = np.array([0.9, 0.6]), np.array([0.3, 0.0])
    # rare positives: a false fire costs more than a miss
    rare = msgspec.structs.replace(f1, positive_share=0.1).better(tp, fp)
    assert rare[1] > rare[0]
    common = msgspec.structs.replace(f1, positive_share=0.9).better(tp, fp)
    assert common[0] > common[1]
    assert f1.better(np.array([1.0]), np.array([0.0]))[0] == pytest.approx(1.0)


def test_fit_ranker_learns_which_view_carries_the_answer():
    rng = np.random.default_rng(3)
    n, tools = 200, 30
    answer = rng.integers(0, tools, n)
    useful = rng.normal(0.3, 0.05, (n, tools))
    useful[np.arange(n), answer] += 0.25  # the view that knows
    noise = rng.normal(0.3, 0.05, (n, tools))
    feats = np.stack([noise, np.zeros((n, tools)), useful], axis=-1)
    ranker = learned.RankerFit().fit(feats, [[a] for a in answer])
    assert ranker.weights[2] > 5 * abs(ranker.weights[0])
    assert (ranker.score(feats).argmax(axis=1) == answer).mean() > 0.9


def test_fit_ranker_weighs_only_the_tools_each_text_was_offered():
    """BFCL's protocol: a text is ranked among the tools its line offers. A view that puts
    tools never offered on top says nothing against the offered ones; fitted over every tool
    it looks harmful, over the offered ones it is the view that knows."""
    rng = np.random.default_rng(4)
    n, tools = 300, 20
    answer = rng.integers(0, 10, n)  # every answer among tools 0-9, each text offered those
    offered = np.zeros((n, tools), bool)
    offered[:, :10] = True
    view = rng.normal(0.3, 0.05, (n, tools))
    view[np.arange(n), answer] += 0.2
    view[:, 10:] += 0.5  # tools 10-19, never offered, score higher still
    feats = np.stack([view, rng.normal(0.3, 0.05, (n, tools))], axis=-1)
    targets = [[a] for a in answer]
    whole, own = learned.RankerFit().fit(feats, targets), learned.RankerFit().fit(feats, targets, offered=offered)
    among = lambda r: (np.where(offered, r.score(feats), -np.inf).argmax(axis=1) == answer).mean()  # noqa: E731
    assert whole.weights[0] < 0 < own.weights[0]
    assert among(own) > 0.9 > among(whole) + 0.3


def test_gate_head_separates_and_round_trips():
    rng = np.random.default_rng(5)
    dim = 8
    vecs = rng.normal(size=(400, dim))
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    y = (vecs[:, 0] > 0).astype(float)  # a direction in embedding space means "needs a tool"
    ex = learned.Exemplars.of(vecs[y == 1][:20], vecs[y == 0][:20])
    scal = rng.normal(size=(400, len(learned.GATE_SCALARS)))
    x = np.hstack([scal, vecs])
    head = learned.GateHeadFit(l2_embedding=100.0).fit(x, y, ex)  # 400 texts: the default (1,000, for thousands) would drown them
    p = head.probability(x)
    assert evaluate.auroc(p[y == 1], p[y == 0]) > 0.95
    again = msgspec.json.decode(msgspec.json.encode(head), type=learned.GateHead)
    assert np.allclose(again.probability(x), p)
    tool, none, _, _ = again.exemplars.arrays()
    assert tool.shape == (20, dim) and np.allclose(tool, vecs[y == 1][:20], atol=1e-3)
    with pytest.raises(ValueError, match="feature count"):
        learned.GateHead(head.mean[:-1], head.scale, head.coef, head.bias, ex)


def test_a_floor_on_the_best_match_scales_down_only_the_texts_under_it_and_keeps_their_order():
    rng = np.random.default_rng(3)
    names, dim = list(learned.GATE_SCALARS), 4
    x = np.hstack([rng.uniform(0, 1, size=(50, len(names))), rng.normal(size=(50, dim))])
    ex = learned.Exemplars.of(np.ones((1, dim)), np.ones((1, dim)))
    head = learned.GateHeadFit(l2_embedding=100.0).fit(x, (x[:, 0] > 0.5).astype(float), ex)
    floored = msgspec.json.decode(msgspec.json.encode(msgspec.structs.replace(head, floor=0.5)), type=learned.GateHead)
    best = np.maximum(x[:, names.index("cosine_top1")], x[:, names.index("cases_top1")])
    p, q = head.probability(x), floored.probability(x)
    assert np.allclose(q[best >= 0.5], p[best >= 0.5]) and np.allclose(q[best < 0.5], p[best < 0.5] * learned.BELOW_FLOOR)
    assert 0 < (best < 0.5).sum() < len(x)
    under = best < 0.5
    assert (np.argsort(q[under]) == np.argsort(p[under])).all()
    keep = [i for i in range(len(head.coef)) if names[i:i + 1] != ["cases_top1"]]  # a head without one of the two
    with pytest.raises(ValueError, match="a floor needs"):
        learned.GateHead(*([getattr(head, a)[i] for i in keep] for a in ("mean", "scale", "coef")), head.bias, ex,
                         [f for f in names if f != "cases_top1"], floor=0.5)


def test_a_head_pulled_toward_a_prior_keeps_what_the_prior_learned_and_data_moves_it():
    """`prior`: the fit is pulled toward another head's logit, rewritten in this fit's own
    standardised coordinates (other means and scales). Pulled hard, it gives the prior's
    probabilities on data it never saw; pulled a little, the new data has its say."""
    rng = np.random.default_rng(7)
    dim, k = 6, len(learned.GATE_SCALARS)
    ex = learned.Exemplars.of(np.eye(dim)[:2], np.eye(dim)[2:4])

    def data(n, shift, scale, direction):
        x = rng.normal(shift, scale, size=(n, k + dim))
        return x, (x[:, k + direction] > shift).astype(float)

    x1, y1 = data(400, 0.0, 1.0, 0)  # the prior's data: dimension 0 decides
    x2, y2 = data(60, 2.0, 3.0, 1)  # a few new texts, elsewhere and spread wider: dimension 1 decides
    prior = learned.GateHeadFit().fit(x1, y1, ex)
    probe, _ = data(200, 1.0, 2.0, 0)
    held = learned.GateHeadFit(l2=1e7, l2_embedding=1e7).fit(x2, y2, ex, prior=prior)
    assert np.allclose(held.probability(probe), prior.probability(probe), atol=0.02)
    alone = learned.GateHeadFit().fit(x2, y2, ex)
    assert not np.allclose(alone.probability(probe), prior.probability(probe), atol=0.1)
    moved = learned.GateHeadFit(l2=1e-3, l2_embedding=1e-3).fit(x2, y2, ex, prior=prior)
    p = moved.probability(x2)
    assert evaluate.auroc(p[y2 == 1], p[y2 == 0]) > 0.95  # weakly held, it learns the new direction


def test_exemplars_pool_with_their_paths():
    e = np.eye(4, dtype=np.float32)
    a = learned.Exemplars.of(e[:1], e[1:2], np.array([True]), np.array([False]))
    b = learned.Exemplars.of(e[2:4], e[3:4], np.array([False, True]), np.array([True]))
    both = a.plus(b).arrays()
    assert both.tool.shape == (3, 4) and both.none.shape == (2, 4)
    assert both.tool_high.tolist() == [True, False, True] and both.none_high.tolist() == [False, True]
    unpathed = learned.Exemplars(4, e[:1].astype(np.float16).tobytes(), e[1:2].astype(np.float16).tobytes())
    assert a.plus(unpathed).arrays().tool_high is None  # one side without paths: every exemplar counts


def test_tune_tries_the_built_in_starts_only_where_a_model_has_them():
    from sidecar.core import models

    assert [s.name for s in tune._starts(models.SMALL_MODEL, "auto")] == ["none", "exemplars", "head"]
    assert [s.name for s in tune._starts(models.SMALL_MODEL, "none")] == ["none"]
    assert [s.name for s in tune._starts("/models/some-other.gguf", "auto")] == ["none"]
    with pytest.raises(ValueError, match="unknown start"):
        tune._starts(models.SMALL_MODEL, "builtin")


def test_nearest_exemplar_is_looked_for_on_the_texts_own_path():
    """A text that took a high pattern's path is compared with the exemplars that took it too;
    a path with no exemplar falls back to all of them; the paths survive the file."""
    e = np.eye(3, dtype=np.float32)
    ex = learned.Exemplars.of(e[:1], np.vstack([e[1], 0.6 * e[0] + 0.8 * e[2]]), np.array([True]), np.array([False, True]))
    known = msgspec.json.decode(msgspec.json.encode(ex), type=learned.Exemplars).arrays()
    assert known.none_high.tolist() == [False, True] and known.tool_high.tolist() == [True]
    q = np.vstack([e[1], e[1]])
    high = np.array([1.0, 0.0])
    assert learned.neighbourhood(q, known).none.tolist() == pytest.approx([1.0, 1.0])  # paths not given: all
    assert learned.neighbourhood(q, known, False, high).none.tolist() == pytest.approx([0.0, 1.0])
    assert learned.neighbourhood(q, known, False, high).tool.tolist() == pytest.approx([0.0, 0.0])  # no own path: all
    assert learned.neighbourhood(q, known, False, np.array([1.0, np.nan])).none.tolist() == pytest.approx([0.0, 1.0])  # NaN: all
    old = learned.Exemplars(3, e[:1].astype(np.float16).tobytes(), e[1:].astype(np.float16).tobytes())  # fitted before paths
    assert old.arrays().none_high is None


def test_query_adapter_learns_a_shift_that_carries_to_new_tools_and_round_trips():
    """Requests that sit off their tools' descriptions by a common direction: the adapter
    fitted on some tools ranks requests for other tools better, and survives the file; with
    no adapter the vectors are untouched."""
    rng = np.random.default_rng(3)
    dim, tools = 16, 40
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    desc = unit(rng.normal(size=(tools, dim)))
    shift = unit(rng.normal(size=dim))
    expect = rng.integers(0, tools, 600)
    requests = unit(desc[expect] + 0.35 * rng.normal(size=(600, dim)) + 1.2 * shift)
    seen = expect < 20  # fitted on tools 0-19, judged on 20-39
    weights = (1.0, 0.0, 0.0, 0.0)
    starts = np.arange(tools)
    fit = np.flatnonzero(seen)
    adapter = learned.AdapterFit(iters=100, lr=1e-2).fit(requests[fit], desc[:20], desc[:20], starts[:20], np.zeros((len(fit), 20)),
                                                         [[int(t)] for t in expect[fit]], weights)  # fmt: skip
    again = msgspec.json.decode(msgspec.json.encode(learned.Ranker(weights, adapter)), type=learned.Ranker)
    w = again.adapter.matrix()
    new = ~seen

    def top1(vectors):
        return float((np.argmax(vectors[new] @ desc.T, axis=1) == expect[new]).mean())

    assert top1(learned.adapt(requests, w)) > top1(requests) + 0.05
    assert learned.adapt(requests, None) is requests
    assert np.allclose(np.linalg.norm(learned.adapt(requests, w), axis=1), 1.0, atol=1e-5)


def test_split_is_reproducible_and_disjoint():
    fit, held = tune.split(100, 0.3, seed=7)
    assert len(held) == 30 and not set(fit) & set(held) and len(fit) + len(held) == 100
    assert tune.split(100, 0.3, seed=7) == (fit, held)
    assert tune.split(100, 0.3, seed=8) != (fit, held)


def test_stacking_folds_hold_out_whole_servers_and_put_talk_with_its_nearest_server():
    servers = [f"s{k}" for k in range(7)]
    items = [Labeled(f"ask {s} {j}", f"{s}__tool{j % 2}") for s in servers for j in range(4)]
    talk = [Labeled(f"talk near {s}", None) for s in servers]
    nearest = [""] * len(items) + [f"{s}__tool0" for s in servers]
    folds = tune._folds(items + talk, nearest, seed=3)
    by_server: dict[str, set[int]] = {}
    for item, near, f in zip(items + talk, nearest, folds):
        server = tune.server_of(min(item.expected)) if item.positive else tune.server_of(near)
        by_server.setdefault(server, set()).add(int(f))
    assert all(len(fs) == 1 for fs in by_server.values())  # a server's requests and its near talk: one fold
    assert len({next(iter(fs)) for fs in by_server.values()}) == tune.FOLDS  # 7 servers over all 5 folds
    assert (tune._folds(items + talk, nearest, seed=3) == folds).all()
    # one server's tools (an intent set): at random, so every tool is in every fold's fitting
    intents = [Labeled(f"want {k} {j}", f"intent{k}") for k in range(3) for j in range(20)]
    random = tune._folds(intents, [""] * len(intents), seed=3)
    assert len({int(f) for f, i in zip(random, intents) if i.expected == {"intent0"}}) > 1


def test_stacking_folds_follow_named_groups():
    """A set that names what its texts were written about: a group's texts share a fold even
    when their nearest tool is another server's, and talk of no group spreads over the folds."""
    servers = [f"s{k}" for k in range(7)]
    items = [Labeled(f"ask {s} {j}", f"{s}__tool{j % 2}", group=s) for s in servers for j in range(4)]
    about = [Labeled(f"talk about {s}", None, group=s) for s in servers]
    chat = [Labeled(f"small talk {j}", None) for j in range(60)]
    nearest = [""] * len(items) + [f"{servers[(k + 1) % 7]}__tool0" for k in range(7)] + ["s0__tool0"] * len(chat)
    folds = tune._folds(items + about + chat, nearest, seed=3)
    fold_of = {s: int(f) for item, f in zip(items, folds) for s in [item.group]}
    assert all(int(f) == fold_of[item.group] for item, f in zip(about, folds[len(items):]))
    assert len({int(f) for f in folds[len(items) + len(about):]}) == tune.FOLDS


def test_neighbourhood_counts_the_nearest_twenty_and_the_share_of_requests_among_them():
    """One stray request beside a text does not make its region a tool region: the best
    cosine says "tool", the k-mean and the vote say "talk"."""
    rng = np.random.default_rng(2)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    centre = unit(rng.normal(size=16))
    talk = unit(centre + 0.3 * rng.normal(size=(40, 16)))
    requests = unit(-centre + 0.3 * rng.normal(size=(40, 16)))
    stray = unit(centre + 0.01 * rng.normal(size=(1, 16)))
    known = learned.Exemplars.of(np.vstack([requests, stray]), talk).arrays()
    near = learned.neighbourhood(centre[None, :], known)
    assert near.tool[0] > near.none[0]  # the stray request is the single nearest text
    assert near.tool_k[0] < near.none_k[0]
    assert near.vote_k[0] == pytest.approx(1 / learned.NEIGHBOURS)
    far = learned.neighbourhood(-centre[None, :], known)
    assert far.vote_k[0] == pytest.approx(1.0) and far.tool_k[0] > far.none_k[0]
    empty = learned.neighbourhood(centre[None, :], learned.Exemplars.of(requests[:0], talk[:0]).arrays())
    assert empty.vote_k.tolist() == [0.0] and empty.tool.tolist() == [0.0]


def test_fitted_thresholds_fire_in_judge_exactly_what_they_fired_in_the_search():
    """`judge` compares a probability rounded to 4 places. Requests at 0.70006 (0.7001 as the
    gate sees it) and texts needing none at 0.70004 (0.7000): the only bar that keeps the FP
    budget is 0.7001; a midpoint between them, rounded, is 0.7 and would let all of them in."""
    score = [0.70006] * 20 + [0.70004] * 20
    positive = [True] * 20 + [False] * 20
    s = tune.GateScores(["fallback"] * 40, score, positive, positive, [None] * 40)
    fit = tune.fit_gate(s, tune.Objective("max_tp", 0.05))
    assert fit.tp_rate == 1.0 and fit.fp_rate == 0.0
    fired = [gate.decide("x", "user", gate.Route("fallback"), [gate.Candidate("t", 0.5, "c")], fit.thresholds, gate.Timing(), p).fired
             for p in score]  # fmt: skip
    assert fired == positive, fit.thresholds


def test_a_threshold_search_that_can_only_meet_its_bound_over_1_says_so():
    """Texts needing none at probability 1.0 cannot be left out by any threshold (they reach
    1 at most): the search must not pick "fire none" at 1.0001 and store 1.0, which fires
    them all while reporting none."""
    score = [0.9] * 10 + [1.0] * 10
    positive = [True] * 10 + [False] * 10
    s = tune.GateScores(["fallback"] * 20, score, positive, positive, [None] * 20)
    with pytest.raises(ValueError, match="no thresholds meet"):
        tune.fit_gate(s, tune.Objective("max_tp", 0.05))
    assert tune.fit_gate(s, tune.Objective("balanced")).thresholds.fallback <= 1.0


def test_a_shared_threshold_is_one_bar_for_both_paths_within_the_budget():
    s = _scores(seed=5, n=400)
    shared = tune.fit_gate(s, tune.Objective("max_tp", 0.05), )
    t = shared.thresholds
    assert t.high == t.fallback == t.confirm and shared.fp_rate <= 0.05
    # it is the best single bar: no other value of one threshold for both paths does better
    for cut in np.unique(np.round(s.score, 4)):
        one = tune.rates(s, Thresholds(high=float(cut), fallback=float(cut), auto=1.0, confirm=float(cut)))
        if one.fp_rate <= 0.05:
            assert shared.tp_rate >= one.tp_rate - 1e-9
    tighter = tune.fit_gate(s, tune.Objective("max_tp", 0.01))
    assert tighter.fp_rate <= 0.01 and tighter.tp_rate <= shared.tp_rate
    assert t.confirm <= t.auto <= 1.0


def test_tune_shows_the_held_out_part_beside_the_calibration_it_replaces():
    """The held-out table: one row a method on the same texts, this tune's beside the one in
    force before it and the baselines, each figure in its column ("–" where a method has none)."""
    import types

    after = tune.Heldout(0.8, 0.033, 0.9, 0.7, 227, top1=0.75, mrr=0.8, auroc=0.977, cosine_auroc=0.895, simple_auroc=0.93, cosine_top1=0.6, bm25_top1=0.55)
    before = tune.Heldout(0.785, 0.141, 0.85, 0.65, 227, top1=0.74, mrr=0.79, auroc=0.913)
    lines = tune.heldout_table(types.SimpleNamespace(heldout=after, before=before, before_origin="builtin"))
    assert lines[0].startswith("  held out (227 items, never fitted")
    cells = {line.split("  ")[2].strip(): line.split() for line in lines[2:]}
    assert list(cells) == ["this tune", "before this tune (built-in)", "plain cosine (one threshold)",
                           "logistic regression on the embedding and cosine", "BM25"]  # fmt: skip
    assert cells["this tune"][-6:] == ["80.0%", "3.3%", "0.977", "70.0%", "75.0%", "0.800"]
    assert cells["before this tune (built-in)"][-6:] == ["78.5%", "14.1%", "0.913", "65.0%", "74.0%", "0.790"]
    assert cells["plain cosine (one threshold)"][-6:] == ["–", "–", "0.895", "–", "60.0%", "–"]
    lines = tune.heldout_table(types.SimpleNamespace(heldout=after, before=None, before_origin=""))
    assert not any("before this tune" in line for line in lines)
