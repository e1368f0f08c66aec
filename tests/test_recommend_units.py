"""The recommender's pure parts: scoring, intent, filters and learning. No model, no SQLite."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sidecar.core.catalog import Tool
from sidecar.store.metrics import Feedback
from sidecar.recommend import filters as F
from sidecar.recommend import intent as I
from sidecar.recommend import learn as L
from sidecar.recommend import scoring as S

# The design's adjustments (off by default: they lost to the fitted ranker), set explicitly.
DESIGN = S.IntentRules(name_action=0.4, name_term=0.2, desc_action=0.2, desc_term=0.1,
                       read_only_vs_write=0.30, write_only_vs_read=0.20, delete_vs_create=0.30)  # fmt: skip

NOW = 1_750_000_000.0


def tool(name, desc="", server="fs", **ann) -> Tool:
    return Tool(name=f"{server}__{name}", description=desc, server=server, annotations=ann or None)


# --- scoring ---------------------------------------------------------------------------------


def test_popularity_formula():
    assert S.popularity(500, 0.0) == pytest.approx(0.5)
    assert S.popularity(500, 30.0) == pytest.approx(0.5 * math.exp(-1))
    assert S.popularity(5000, 0.0) == pytest.approx(1.0)  # capped
    assert S.popularity(500, 0.0, agent_success_rate=1.0) == pytest.approx(0.75)  # bias 1.5
    assert S.popularity(500, 0.0, agent_success_rate=0.0) == pytest.approx(0.25)  # bias 0.5


def test_performance_formula():
    assert S.performance(0) == 1.0
    assert S.performance(250) == pytest.approx(0.75)
    assert S.performance(5000) == 0.0


def test_few_calls_get_neutral_priors_not_a_penalty():
    two_failures = S.History(calls=2, successes=0, avg_latency_ms=5000, last_called_at=NOW)
    hf = S.history_factors(two_failures, NOW, min_calls=3, typical_popularity=0.2)
    assert hf.prior and (hf.success, hf.performance, hf.rating, hf.popularity) == (1.0, 1.0, 1.0, 0.2)
    three = S.history_factors(S.History(calls=3, successes=0, avg_latency_ms=5000, last_called_at=NOW), NOW)
    assert not three.prior and three.success == 0.0 and three.performance == 0.0


def test_agent_bias_needs_the_agents_own_history():
    h = S.History(calls=500, successes=500, last_called_at=NOW, agent_calls=10, agent_successes=10)
    assert S.history_factors(h, NOW).popularity == pytest.approx(0.75)
    h2 = S.History(calls=500, successes=500, last_called_at=NOW, agent_calls=1, agent_successes=1)
    assert S.history_factors(h2, NOW).popularity == pytest.approx(0.5)


def test_weights_are_used_normalised_and_validated():
    w = S.Weights(2, 0, 0, 0, 2)
    assert S.combine(w, (1.0, 0.0, 0.0, 0.0, 0.0)) == pytest.approx(0.5)
    assert S.combine(S.Weights(), (1, 1, 1, 1, 1)) == pytest.approx(1.0)
    assert sum(S.contributions(S.Weights(), (1, 1, 1, 1, 1)).values()) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        S.Weights(-1, 1, 1, 1, 1)
    with pytest.raises(ValueError):
        S.Weights(0, 0, 0, 0, 0)


# --- intent ----------------------------------------------------------------------------------


def test_stems_agree_across_forms():
    assert I.stem("saving") == I.stem("saves") == I.stem("save")
    assert I.stem("created") == I.stem("creating") == I.stem("create")
    assert I.stem("written") == I.stem("write")
    assert I.stem("embed") == "embed"


def test_analyze_finds_actions_domains_and_terms():
    it = I.analyze("Save the results to a CSV file in the repo")
    assert I.stem("save") in it.actions and it.wants_write and not it.wants_read
    assert {"data", "files", "code"} <= set(it.domains)
    assert I.stem("csv") in it.technical
    assert I.analyze("load my settings").wants_read
    assert I.analyze("remove the draft").wants_delete
    assert I.analyze("add a new user").wants_create


def test_profile_reads_names_and_annotations():
    assert I.profile(tool("read_text_file", "Read a file as text")).read_only
    w = I.profile(tool("write_file", "Create or overwrite a file"))
    assert w.write_only and not w.read_only
    assert I.profile(tool("delete_note")).deletes
    assert I.profile(tool("do_thing", readOnlyHint=True)).read_only
    assert not I.profile(tool("read_and_update", readOnlyHint=False)).read_only


def test_save_boosts_writers_and_penalises_readers():
    it = I.analyze("save a text file")
    write = S.intent_adjustment(it, I.profile(tool("write_file", "Create a new file or overwrite an existing file")), DESIGN)
    read = S.intent_adjustment(it, I.profile(tool("read_text_file", "Read the complete contents of a text file")), DESIGN)
    assert write.multiplier > read.multiplier
    assert f"{I.stem('save')}→{I.stem('write')}" in write.matched
    assert read.penalties and "read-only" in read.penalties[0] and "-30%" in read.penalties[0]
    assert not write.penalties


def test_other_conflict_penalties():
    rules = DESIGN
    reader = S.intent_adjustment(I.analyze("read the log"), I.profile(tool("write_log", "Append to the log")), rules)
    assert any("write-only" in p and "-20%" in p for p in reader.penalties)
    creator = S.intent_adjustment(I.analyze("create a note"), I.profile(tool("delete_note", "Remove a note")), rules)
    assert any("delete tool" in p for p in creator.penalties)


def test_action_words_weigh_more_and_returns_diminish():
    rules = DESIGN
    prof = I.profile(tool("zzz_file", ""))
    one_term = S.intent_adjustment(I.analyze("file"), prof, rules)
    assert one_term.name_boost == pytest.approx(rules.name_term)
    act = S.intent_adjustment(I.analyze("write"), I.profile(tool("write_zzz", "")), rules)
    assert act.name_boost == pytest.approx(rules.name_action)
    both = S.intent_adjustment(I.analyze("write file"), I.profile(tool("write_file", "")), rules)
    assert both.name_boost == pytest.approx((rules.name_action + rules.name_term) * rules.decay)


# --- filters ---------------------------------------------------------------------------------


def _excl(t: Tool, ctx: F.Context, facts: F.Facts = F.Facts()) -> str | None:
    return F.exclusion(t, I.profile(t), F.tool_tags(t), ctx, facts)


def test_permissions():
    w, r, d = tool("write_file"), tool("read_file"), tool("delete_file")
    assert _excl(w, F.Context(permissions=F.Permissions(read_only=True))) == "session is read-only"
    assert _excl(r, F.Context(permissions=F.Permissions(read_only=True))) is None
    assert _excl(d, F.Context(permissions=F.Permissions(destructive=False)))
    assert _excl(w, F.Context(permissions=F.Permissions(allow=["fs__read_*"]))) == "not allowed for this session"
    assert _excl(r, F.Context(permissions=F.Permissions(allow=["read_*"]))) is None  # bare names match too
    assert _excl(r, F.Context(permissions=F.Permissions(deny=["fs__*"]))) == "denied for this session"


def test_availability_and_rate_limits():
    t = tool("read_file")
    assert "failing" in _excl(t, F.Context(), F.Facts(failing_servers=frozenset({"fs"})))
    assert "failing" in _excl(t, F.Context(unavailable_servers=["fs"]))
    facts = F.Facts(recent_calls={("fs", "read_file"): 5}, rate_limit=5)
    assert _excl(t, F.Context(), facts) == "rate limit reached for this agent"
    assert _excl(t, F.Context(), F.Facts(recent_calls={("fs", "read_file"): 4}, rate_limit=5)) is None


def test_project_tags():
    py = tool("run_pytest", "Run the Python test suite")
    js = tool("run_jest", "Run the JavaScript tests with jest")
    plain = tool("read_file", "Read a file")
    ctx = F.Context(project_tags=["python"])
    assert _excl(py, ctx) is None and _excl(plain, ctx) is None
    assert "javascript" in _excl(js, ctx)
    tagged = Tool(name="x", annotations={"tags": ["web"]})
    assert _excl(tagged, F.Context(project_tags=["data"])) and _excl(tagged, F.Context(project_tags=["web"])) is None


def test_failing_servers_from_recent_calls():
    from sidecar.store.metrics import CallCount

    recent = {("a", "t1"): CallCount(4, 0), ("a", "t2"): CallCount(2, 1), ("b", "t"): CallCount(10, 9), ("c", "t"): CallCount(2, 0)}
    assert F.failing_servers(recent, min_calls=5, failure_rate=0.8) == frozenset({"a"})


def test_context_rejects_unknown_source():
    with pytest.raises(ValueError):
        F.Context(source="tool")


# --- learning --------------------------------------------------------------------------------


def test_variant_assignment_is_deterministic_and_spread():
    arms = ["control", "variant_a", "variant_b"]
    assert L.assign_variant("agent-42", arms) == L.assign_variant("agent-42", list(reversed(arms)))
    counts = {a: 0 for a in arms}
    for i in range(600):
        counts[L.assign_variant(f"agent-{i}", arms)] += 1
    assert all(150 < c < 250 for c in counts.values()), counts


def test_offline_evaluation():
    rows = [
        Feedback("q1", ["a", "b", "c"], "a"),
        Feedback("q2", ["a", "b", "c"], "c"),
        Feedback("q3", ["b", "d"], "x"),
        Feedback("q4", ["e"], None),
    ]
    ev = L.evaluate(rows, catalog_size=10)
    assert ev.n == 3 and ev.not_recommended == 1
    assert ev.mrr == pytest.approx(round((1 + 1 / 3) / 3, 4))
    assert ev.precision == {"1": pytest.approx(1 / 3, abs=1e-4), "3": pytest.approx(2 / 3, abs=1e-4), "5": pytest.approx(2 / 3, abs=1e-4), "10": pytest.approx(2 / 3, abs=1e-4)}
    assert ev.ndcg == pytest.approx(round((1 + 1 / math.log2(4)) / 3, 4))
    assert ev.coverage == pytest.approx(0.5)  # a..e of 10


def test_variants_are_evaluated_apart():
    rows = [Feedback("q", ["a", "b"], "a", variant="A"), Feedback("q", ["a", "b"], "b", variant="B")]
    ev = L.by_variant(rows)
    assert ev["A"].mrr == 1.0 and ev["B"].mrr == 0.5


def _synthetic_samples(n=80, seed=0):
    """Relevance is noisy, success rate tells which tool the user picked."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        f = rng.uniform(0.5, 1.0, size=(6, 5))
        f[:, 1] = 0.3
        sel = int(rng.integers(6))
        f[sel, 1] = 1.0
        f[sel, 0] = f[:, 0].min() + 0.01  # the chosen one is never the most "relevant"
        out.append(L.Sample(f, sel, f"fb-{k}"))
    return out


def test_tuning_is_reproducible_and_improves_the_selected_rank():
    samples = _synthetic_samples()
    a = L.tune(samples, heldout_fraction=0.25)
    b = L.tune(list(samples), heldout_fraction=0.25)
    assert a.weights == b.weights
    assert sum(a.weights.as_tuple()) == pytest.approx(1.0)
    assert a.train_mrr_after > a.train_mrr_before
    assert a.heldout and a.heldout_mrr_after > a.heldout_mrr_before
    assert a.weights.success > S.Weights().normalised().success


def test_tuning_keeps_the_start_when_nothing_is_learnt():
    flat = [L.Sample(np.ones((3, 5)), 0, str(i)) for i in range(5)]
    res = L.tune(flat)
    assert res.weights.as_tuple() == pytest.approx(S.Weights().normalised().as_tuple(), abs=1e-9)


def test_ties_rank_pessimistically():
    s = L.Sample(np.ones((4, 5)), 2)
    assert L.sample_mrr([s], np.asarray([S.Weights().normalised().as_tuple()]))[0] == pytest.approx(0.25)
