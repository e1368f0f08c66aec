"""`sidecar eval` and `sidecar tune` end to end: real model, real store, real files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from sidecar.core import calibration, models
from sidecar.learn import learned
from tests.conftest import CATALOGS, ROOT

NOTES = str(CATALOGS / "notes.json")

POSITIVES = [
    ("take a note about the meeting with Dana", "create_note", "user"),
    ("save this for later: the wifi password is hunter2", "create_note", "user"),
    ("jot down that the release moved to Friday", "create_note", "user"),
    ("open my note about groceries", "read_note", "user"),
    ("show me what my kubernetes note says", "read_note", "user"),
    ("what did I write about the offsite?", "semantic_search", "user"),
    ("find notes mentioning postgres upgrades", "semantic_search", "user"),
    ("search my notes for anything about taxes", "semantic_search", "user"),
    ("delete the note about the old project", "delete_note", "user"),
    ("get rid of my groceries note", "delete_note", "user"),
    ("add a line to the standup note saying I'm out Monday", "update_note", "user"),
    ("fix the typo in my todo note", "update_note", "user"),
    ("list all my notes", "list_notes", "user"),
    ("which notes do I have?", "list_notes", "user"),
    ("Let me create a note with this summary.", "create_note", "llm"),
    ("I'll search your notes for the deployment steps.", "semantic_search", "llm"),
    ("First I'll open the note called roadmap.", "read_note", "llm"),
    ("I'm going to append these action items to your standup note.", "update_note", "llm"),
]
NEGATIVES = [
    ("thanks a lot, that's perfect", "user"),
    ("the search algorithm is O(log n)", "user"),
    ("what is the capital of France?", "user"),
    ("explain recursion like I'm five", "user"),
    ("CRUD apps are boring", "user"),
    ("you would use a database for that", "llm"),
    ("I love this song", "user"),
    ("how does garbage collection work in Go?", "user"),
    ("nice, that works", "user"),
    ("the note she sang was off-key", "user"),
    ("write amplification hurts LSM trees", "user"),
    ("tell me a joke", "user"),
    ("Here's a summary of the changes:", "llm"),
    ("In short, the bug was an off-by-one.", "llm"),
    ("good morning!", "user"),
    ("Hope that helps.", "llm"),
    ("I think the second option is cleaner.", "llm"),
    ("why is the sky blue", "user"),
]


@pytest.fixture(scope="module")
def labeled(tmp_path_factory):
    path = tmp_path_factory.mktemp("labeled") / "set.jsonl"
    lines = [{"text": t, "expect": e, "source": s} for t, e, s in POSITIVES]
    lines += [{"text": t, "expect": None, "source": s} for t, s in NEGATIVES]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _cli(*args, tmp_path):
    env = {**os.environ, "SIDECAR_STORE": str(tmp_path / "cli.db")}
    return subprocess.run([sys.executable, "-m", "sidecar", *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_eval_json_has_every_figure(labeled, tmp_path):
    per_item = tmp_path / "items.jsonl"
    run = _cli("eval", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled, "--items", per_item, tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["n"] == len(POSITIVES) + len(NEGATIVES)
    assert out["model"] == models.SMALL_MODEL
    assert set(out["gate"]) >= {"tp_rate", "fp_rate", "accuracy", "balanced_accuracy", "auroc"}
    assert set(out["ranking"]) >= {"top1", "top3", "mrr", "ndcg@10", "coverage"}
    assert set(out["latency_ms"]) == {"p50", "p99"}
    assert out["gate"]["auroc"] > 0.8  # a real model separates these clearly
    assert out["ranking"]["top3"] >= out["ranking"]["top1"] > 0.5
    base = {b["kind"]: b["ranking"] for b in out["baselines"]}  # computed in the same run, on the same items
    assert set(base) == {"cosine", "bm25", "tfidf"} and all(0 <= b["top1"] <= 1 for b in base.values())
    assert out["ranking_ranker"]["top1"] >= base["cosine"]["top1"] - 0.1
    assert 0.5 <= out["gate_baseline"]["auroc"] <= 1

    # --items: one line per item, in order, that adds up to the report's rates
    rows = [json.loads(line) for line in per_item.read_text().splitlines()]
    assert [r["text"] for r in rows] == [t for t, *_ in POSITIVES] + [t for t, _ in NEGATIVES]
    pos, neg = rows[: len(POSITIVES)], rows[len(POSITIVES) :]
    assert {r["verdict"] for r in pos} <= {"right", "wrong_tool", "missed"} and {r["verdict"] for r in neg} <= {"false_fire", "silent"}
    assert sum(r["fired"] for r in pos) / len(pos) == pytest.approx(out["gate"]["tp_rate"])
    assert sum(r["verdict"] == "false_fire" for r in neg) / len(neg) == pytest.approx(out["gate"]["fp_rate"])
    assert sum(r["verdict"] == "right" for r in pos) / len(pos) == pytest.approx(out["gate"]["correct_rate"])
    assert sum(r["rank"] == 1 for r in pos) / len(pos) == pytest.approx(out["ranking"]["top1"])
    for r, (_, expect, _) in zip(pos, POSITIVES):
        assert r["expect"] == [expect] and (r["rank"] == 1) == (r["top"][0] == expect)
        assert r["verdict"] != "right" or r["first"] == expect
    assert all(0 <= r["probability"] <= 1 for r in rows if r["probability"] is not None)
    assert f"{len(rows)} items written to {per_item}" in run.stderr


def test_eval_refuses_an_items_path_it_cannot_write_before_loading_anything(labeled, tmp_path):
    run = _cli("eval", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled, "--items", tmp_path / "no" / "such" / "x.jsonl", tmp_path=tmp_path)
    assert run.returncode == 2 and "no such directory" in run.stderr
    assert not (tmp_path / "cli.db").exists()  # refused before the store or the model was touched


def test_tune_writes_a_calibration_that_detect_uses(labeled, tmp_path):
    cal, png = tmp_path / "cal.json", tmp_path / "gate.png"
    run = _cli("tune", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled,
               "--heldout-fraction", "0", "--objective", "balanced", "--out", cal, "--plot", png, tmp_path=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["objective"] == "balanced"
    assert out["fit"]["tp_rate"] > out["fit"]["fp_rate"]  # out of fold: texts the head never saw
    assert len(out["ranker"]["weights"]) == len(learned.RANK_FEATURES) and out["ranker"]["weights"][3] == 0  # no own cases: no classifier view
    # the model has a built-in calibration: three starts tried out of fold, the best one kept
    assert list(out["starts"]) == ["none", "exemplars", "head"] and out["starts"][out["start"]] == max(out["starts"].values())
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    fitted = calibration.read(cal)
    assert fitted.model == models.SMALL_MODEL and fitted.head is not None and fitted.ranker is not None
    # the match floor: the least best-tool cosine 99% of the fitted requests reach
    assert fitted.head.floor is not None and 0 < fitted.head.floor < 1
    assert fitted.thresholds.high == pytest.approx(out["calibration"]["high"])
    det = _cli("detect", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--calibration", cal, "hello there", tmp_path=tmp_path)
    assert det.returncode == 0, det.stderr
    d = json.loads(det.stdout)
    assert d["thresholds_origin"] == "calibration"
    assert d["thresholds"]["fallback"] == pytest.approx(fitted.thresholds.fallback)
    assert 0 <= d["probability"] <= 1 and not d["fired"]  # a probability now, and small talk stays silent


def test_tune_plot_without_matplotlib_fails_before_any_work(labeled, tmp_path):
    env_path = tmp_path / "nomatplotlib"
    env_path.mkdir()
    (env_path / "matplotlib.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {**os.environ, "SIDECAR_STORE": str(tmp_path / "cli.db"), "PYTHONPATH": str(env_path)}
    run = subprocess.run([sys.executable, "-m", "sidecar", "tune", "--model", models.SMALL_MODEL, "--catalog", NOTES,
                          "--labeled", labeled, "--plot", tmp_path / "x.png"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)  # fmt: skip
    assert run.returncode == 2 and "--plot needs matplotlib" in run.stderr
    assert not (tmp_path / "cli.db").exists()  # refused before the store or the model was touched


def test_tune_refuses_a_non_positive_l2_before_any_work(labeled, tmp_path):
    run = _cli("tune", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled, "--l2-embedding", "0", tmp_path=tmp_path)
    assert run.returncode == 2 and "--l2-embedding must be positive" in run.stderr
    assert not (tmp_path / "cli.db").exists()


def test_tune_refuses_an_absent_share_outside_0_1_before_any_work(labeled, tmp_path):
    run = _cli("tune", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled, "--absent-share", "1.5", tmp_path=tmp_path)
    assert run.returncode == 2 and "--absent-share must be within [0, 1]" in run.stderr
    assert not (tmp_path / "cli.db").exists()


def test_absent_share_fits_requests_once_more_as_needing_none(labeled, tmp_path):
    """Every request once more against a catalog without its tool (a one-server catalog: the
    other tools), as "needs none": the head is fitted on more rows and moves."""
    heads = {}
    for share in ("0", "1"):
        cal = tmp_path / f"cal{share}.json"
        run = _cli("tune", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled, "--heldout-fraction", "0",
                   "--start", "none", "--absent-share", share, "--out", cal, tmp_path=tmp_path)  # fmt: skip
        assert run.returncode == 0, run.stderr
        rows = int(re.search(r"fitting the gate head on (\d+) rows", run.stderr).group(1))
        assert rows == 2 * len(POSITIVES + NEGATIVES) + (len(POSITIVES) if share == "1" else 0)
        heads[share] = calibration.read(cal).head
    assert heads["0"].coef != heads["1"].coef


def test_calibration_for_another_model_is_refused(labeled, tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"model": models.DEFAULT_MODEL, "thresholds": {"high": 0.5, "fallback": 0.7, "auto": 0.8, "confirm": 0.5}}))
    run = _cli("eval", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled, "--calibration", cal, tmp_path=tmp_path)
    assert run.returncode == 2
    assert "fitted on 'nomic-embed-text-v1.5'" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_eval_names_the_bad_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "take a note", "expect": "create_note"}\n{"text": "x", "expect": "no_such_tool"}\n')
    run = _cli("eval", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", bad, tmp_path=tmp_path)
    assert run.returncode == 2
    assert f"{bad}:2: expected tool(s) not in the catalog: no_such_tool" in run.stderr


NOTE_TOOLS = ["create_note", "read_note", "update_note", "delete_note", "semantic_search", "list_notes", "discover_tools"]


def _eval_json(path, tmp_path, *extra):
    run = _cli("eval", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", path, *extra, tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_items_that_offer_the_whole_catalog_score_as_items_that_offer_nothing(labeled, tmp_path):
    """BFCL's protocol (`offered`: judge a text against only those tools) goes through the same
    engine, so offering every tool must change no figure."""
    every = tmp_path / "every.jsonl"
    every.write_text("".join(json.dumps({**json.loads(line), "offered": NOTE_TOOLS[::-1], "id": k}) + "\n"
                             for k, line in enumerate(labeled.read_text().splitlines())))
    plain, offered = _eval_json(labeled, tmp_path), _eval_json(every, tmp_path)
    rounded = lambda x: json.loads(json.dumps(x), parse_float=lambda f: round(float(f), 9))  # noqa: E731
    for key in ("gate", "ranking", "ranking_ranker", "baselines", "gate_baseline", "by_source"):
        assert rounded(offered[key]) == rounded(plain[key]), key


def test_each_item_is_judged_and_ranked_against_only_the_tools_it_offers(tmp_path):
    """Each request offers its own tool and two others; each text needing none offers tools
    that do not answer it. Rankings (the sidecar's and the baselines') hold only offered tools."""
    rng = __import__("random").Random(0)
    lines = []
    for k, (text, expect, source) in enumerate(POSITIVES):
        others = rng.sample([t for t in NOTE_TOOLS if t != expect], 2)
        lines.append({"id": f"p{k}", "text": text, "expect": expect, "source": source, "offered": [expect, *others]})
    for k, (text, source) in enumerate(NEGATIVES):
        lines.append({"id": f"n{k}", "text": text, "expect": None, "source": source, "offered": rng.sample(NOTE_TOOLS, 1)})
    lines.append({"id": "none offered", "text": POSITIVES[0][0], "expect": None, "source": "user", "offered": []})  # BFCL has such items
    path, per_item = tmp_path / "offered.jsonl", tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    whole_path = tmp_path / "whole.jsonl"  # the same items against the whole catalog
    whole_path.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "offered"}) + "\n" for x in lines))
    out, whole = _eval_json(path, tmp_path, "--items", per_item), _eval_json(whole_path, tmp_path)
    rows = [json.loads(line) for line in per_item.read_text().splitlines()]
    assert [r["id"] for r in rows] == [x["id"] for x in lines]
    for r, x in zip(rows, lines):
        assert set(r.get("top", [])) <= set(x["offered"]), (r["text"], r.get("top"), x["offered"])
        assert r.get("top") or x["expect"] is None  # every request is ranked
        assert r.get("first") is None or r["first"] in x["offered"]
    assert rows[-1]["verdict"] == "silent"  # nothing to inject: nothing fires
    # three tools to choose from instead of seven: no ranking gets worse, and plain cosine's
    # and BM25's are measured over the same three
    for key in ("ranking", "ranking_ranker"):
        assert out[key]["top1"] >= whole[key]["top1"]
    for b, w in zip(out["baselines"], whole["baselines"]):
        assert b["kind"] == w["kind"] and b["ranking"]["top1"] >= w["ranking"]["top1"] and b["ranking"]["coverage"] <= 1


def test_offered_tools_must_be_known_and_hold_the_expected_ones(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "take a note", "expect": "create_note", "offered": ["create_note"]}\n'
                   '{"text": "x", "expect": null, "offered": ["create_note", "no_such_tool"]}\n')
    run = _cli("eval", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", bad, tmp_path=tmp_path)
    assert run.returncode == 2 and f"{bad}:2: offered tool(s) not in the catalog: no_such_tool" in run.stderr
    bad.write_text('{"text": "take a note", "expect": "create_note", "offered": ["list_notes"]}\n')
    run = _cli("eval", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", bad, tmp_path=tmp_path)
    assert run.returncode == 2 and f"{bad}:1: expected tool(s) not among the offered ones: create_note" in run.stderr


def test_cascade_refuses_items_that_offer_their_own_tools(labeled, tmp_path):
    offered = tmp_path / "offered.jsonl"
    offered.write_text("".join(json.dumps({**json.loads(line), "offered": NOTE_TOOLS}) + "\n" for line in labeled.read_text().splitlines()))
    for extra in ((), ("--out-of-fold",)):
        run = _cli("cascade", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", offered, *extra, tmp_path=tmp_path)
        assert run.returncode == 2 and "cascade judges every text against the whole catalog" in run.stderr
        assert f"{len(POSITIVES) + len(NEGATIVES)} item(s) offer their own tools" in run.stderr
    assert not (tmp_path / "cli.db").exists()  # refused before the store or a model was touched


def test_tune_on_the_fewest_texts_it_accepts_keeps_its_probabilities_finite(tmp_path):
    """8 requests and 8 texts needing none, hundreds of embedding dimensions: the gate head's
    gradient descent must not overshoot (it did at a fixed step: 15 of 16 out-of-fold
    probabilities came out exactly 0 or 1, and thresholds of 1.0 fired 75% of the negatives)."""
    from sidecar.core import catalog as catalog_mod
    from sidecar import config
    from sidecar.lab import tune
    from sidecar.lab.evaluate import Labeled

    items = [Labeled(t, e, s) for t, e, s in POSITIVES[::2][:8]] + [Labeled(t, None, s) for t, s in NEGATIVES[::2][:8]]
    cfg = config.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("store",): str(tmp_path / "sidecar.db")})
    fitted = tune.fit(items, catalog_mod.load([NOTES]), cfg, tune.Objective(), heldout_fraction=0.0, start="none")  # the descent itself
    assert fitted.start == "none" and list(fitted.starts) == ["none"]
    scores = fitted.gate_scores.score
    assert all(0.0 < p < 1.0 for p in scores), scores
    assert fitted.fit.fp_rate <= 0.05 and fitted.fit.tp_rate > 0.5, fitted.fit


def test_tune_reports_the_held_out_part_beside_baselines_eval_agrees_with(labeled, tmp_path):
    """The part `tune` keeps out is judged by the finished calibration and by the simplest
    gates and rankings of the same run (plain cosine, BM25, a logistic regression on the
    embedding and plain cosine's scores fitted on the fit part); `eval` on those texts with
    the calibration written gives the same gate AUROC and the same baselines."""
    from sidecar.lab import tune

    cal, held = tmp_path / "cal.json", tmp_path / "held.jsonl"
    run = _cli("tune", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled,
               "--heldout-fraction", "0.4", "--seed", "3", "--start", "none", "--out", cal, tmp_path=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    h = json.loads(run.stdout)["heldout"]
    lines = labeled.read_text().splitlines()
    _, held_idx = tune.split(len(lines), 0.4, 3)
    assert h["n"] == len(held_idx)
    held.write_text("".join(lines[i] + "\n" for i in held_idx))
    ev = _cli("eval", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", held, "--calibration", cal, tmp_path=tmp_path)
    assert ev.returncode == 0, ev.stderr
    out = json.loads(ev.stdout)
    base = {b["kind"]: b["ranking"]["top1"] for b in out["baselines"]}
    assert h["auroc"] == pytest.approx(out["gate"]["auroc"]) and h["top1"] == pytest.approx(out["ranking"]["top1"])
    assert h["cosine_auroc"] == pytest.approx(out["gate_baseline"]["auroc"])
    assert (h["cosine_top1"], h["bm25_top1"]) == pytest.approx((base["cosine"], base["bm25"]))
    assert 0.5 < h["simple_auroc"] <= 1  # fitted on 21 texts, it still separates better than chance

    # beside it, the same texts judged by the calibration in force before the tune (the
    # model's built-in here): what `eval` gives them without --calibration
    before = json.loads(run.stdout)["before"]
    assert json.loads(run.stdout)["before_origin"] == "builtin" and before["n"] == h["n"]
    ev = _cli("eval", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", held, tmp_path=tmp_path)
    assert ev.returncode == 0, ev.stderr
    out = json.loads(ev.stdout)
    assert out["thresholds_origin"] == "builtin"
    assert (before["tp_rate"], before["fp_rate"], before["auroc"], before["correct_rate"], before["top1"]) == pytest.approx(
        (out["gate"]["tp_rate"], out["gate"]["fp_rate"], out["gate"]["auroc"], out["gate"]["correct_rate"], out["ranking"]["top1"]))


def test_simple_gate_chooses_its_penalty_out_of_fold_and_separates_what_is_separable():
    import numpy as np

    from sidecar.lab.evaluate import auroc, simple_gate, simple_gate_features

    rng = np.random.default_rng(0)
    y = (rng.random(300) < 0.5).astype(float)
    vectors = rng.standard_normal((300, 16))
    vectors[:, 0] += 2.0 * y  # one direction of the embedding says "needs a tool"
    cosines = rng.random((300, 7)) * 0.1  # plain cosine says nothing here
    x = simple_gate_features(cosines, vectors)
    assert x.shape == (300, 3 + 16)
    p = simple_gate(x[:200], y[:200], np.arange(200) % 5)(x[200:])
    assert auroc(p[y[200:] > 0], p[y[200:] == 0]) > 0.85


def test_tune_on_items_that_offer_every_tool_fits_what_it_fits_on_items_that_offer_nothing(labeled, tmp_path):
    """`tune` fits each line against the tools it offers (BFCL's protocol, or a log of what each
    chat was offered): offering every tool must change no weight, threshold or figure."""
    every = tmp_path / "every.jsonl"
    every.write_text("".join(json.dumps({**json.loads(line), "offered": NOTE_TOOLS[::-1]}) + "\n" for line in labeled.read_text().splitlines()))
    outs = []
    for path in (labeled, every):
        cal = tmp_path / f"{path.stem}.cal.json"
        run = _cli("tune", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", path,
                   "--heldout-fraction", "0.3", "--start", "none", "--out", cal, tmp_path=tmp_path)  # fmt: skip
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        outs.append((cal.read_bytes(), {k: out[k] for k in ("calibration", "ranker", "fit", "heldout")}))
    assert outs[0] == outs[1]


def test_tune_fits_and_judges_each_item_against_only_the_tools_it_offers(labeled, tmp_path):
    """Each request offers its own tool and one other; each text needing none one tool. The
    held-out part is judged as `eval` judges it (each against its own tools), and the fit
    differs from one against the whole catalog."""
    rng = __import__("random").Random(1)
    lines = [json.loads(line) for line in labeled.read_text().splitlines()]
    for x in lines:
        x["offered"] = [x["expect"], rng.choice([t for t in NOTE_TOOLS if t != x["expect"]])] if x["expect"] else rng.sample(NOTE_TOOLS, 1)
    path = tmp_path / "offered.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cal = tmp_path / "cal.json"
    run = _cli("tune", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", path,
               "--heldout-fraction", "0.4", "--seed", "3", "--start", "none", "--out", cal, tmp_path=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    h = out["heldout"]
    from sidecar.lab import tune

    _, held_idx = tune.split(len(lines), 0.4, 3)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(lines[i]) + "\n" for i in held_idx))
    ev = _eval_json(held, tmp_path, "--calibration", cal)
    assert h["n"] == len(held_idx) == ev["n"]
    assert h["top1"] == pytest.approx(ev["ranking_ranker"]["top1"]) and h["auroc"] == pytest.approx(ev["gate"]["auroc"])
    assert h["tp_rate"] == pytest.approx(ev["gate"]["tp_rate"]) and h["fp_rate"] == pytest.approx(ev["gate"]["fp_rate"])
    assert h["cosine_top1"] == pytest.approx({b["kind"]: b["ranking"]["top1"] for b in ev["baselines"]}["cosine"])
    whole = _cli("tune", "--json", "--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", labeled,
                 "--heldout-fraction", "0.4", "--seed", "3", "--start", "none", tmp_path=tmp_path)  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    assert json.loads(whole.stdout)["ranker"]["weights"] != out["ranker"]["weights"]


def test_chat_logs_read_as_labelled_data(tmp_path):
    """Each user turn expects the tools called before the next user turn (first-called order,
    each once), or none; a turn whose reply called nothing is a 'no tool' line."""
    from sidecar.lab.evaluate import from_transcripts
    from sidecar.transcripts import read_transcripts

    call = lambda name: {"type": "function", "function": {"name": name, "arguments": "{}"}}  # noqa: E731
    chat = {"id": "c1", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "find my note on postgres, then add today's date to it"},
        {"role": "assistant", "content": None, "tool_calls": [call("semantic_search")]},
        {"role": "tool", "content": "found it"},
        {"role": "assistant", "content": None, "tool_calls": [call("update_note"), call("semantic_search")]},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "thanks!"},
        {"role": "assistant", "content": "Any time."},
        {"role": "user", "content": "list my notes"},
        {"role": "assistant", "content": None, "tool_calls": [call("list_notes")]},
    ]}  # fmt: skip
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(chat))
    items = from_transcripts(read_transcripts([path]))
    assert [(i.text, i.expect, i.source) for i in items] == [
        ("find my note on postgres, then add today's date to it", ["semantic_search", "update_note"], "user"),
        ("thanks!", None, "user"),
        ("list my notes", "list_notes", "user"),
    ]


def test_tune_fits_on_chat_logs(tmp_path):
    """`sidecar tune --transcripts`: the logs `replay` reads, as the only labelled data; the
    calibration it writes is one `detect` takes. Without --labeled or --transcripts it refuses."""
    sample = ROOT / "fixtures" / "transcripts" / "bfcl-live"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    out = tmp_path / "cal.json"
    args = ["--model", models.SMALL_MODEL, "--catalog", str(sample / "catalog.json")]
    done = subprocess.run([sys.executable, "-m", "sidecar", "tune", *args, "--transcripts", str(sample / "sample.jsonl"), "--heldout-fraction", "0.3",
                           "--out", str(out), "--json", "-q"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["heldout"]["n"] == 13  # 44 user turns in the sample, 30% held out
    cal = calibration.read(out)
    assert cal.model == models.SMALL_MODEL and cal.head is not None
    detect = subprocess.run([sys.executable, "-m", "sidecar", "detect", *args, "--calibration", str(out), "--json", "what's the weather in Boston?"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert detect.returncode == 0 and json.loads(detect.stdout)["thresholds_origin"] == "calibration", detect.stderr
    refused = subprocess.run([sys.executable, "-m", "sidecar", "tune", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert refused.returncode == 2 and "give --labeled FILE or --transcripts FILE" in refused.stderr


# The strategies the design names (its study of embedding strategies for intent detection): its
# building blocks, the combinations it measured (`prefix+mcp` its choice for production), the
# negative patterns on top, and the tiered gate.
DESIGN_STRATEGIES = {"base", "prefix", "mcp", "llm", "action", "prefix+mcp", "prefix+llm", "mcp+llm", "prefix+mcp+negative", "tiered", "tiered:auto"}


def test_tune_compares_every_strategy_of_the_design_first(tmp_path):
    """`tune --strategies --json`: a matrix row per strategy of the design, judged on the fit
    part before fitting (here all of it); the tiered rows are the product's calibrated gate,
    the very figures `eval` reports on the same texts; the Pareto front is the rows no other
    row beats on TP, FP and top-1, and the winner the row the objective scores best."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")}
    labeled = ["--model", models.SMALL_MODEL, "--catalog", NOTES, "--labeled", str(ROOT / "fixtures" / "labeled" / "notes.jsonl")]
    done = subprocess.run([sys.executable, "-m", "sidecar", "tune", *labeled, "--heldout-fraction", "0", "--strategies", "--json", "-q"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {r["strategy"]: r for r in json.loads(done.stdout)["matrix"]}
    assert DESIGN_STRATEGIES <= set(rows)
    assert rows["llm"]["rows"] > rows["base"]["rows"] and rows["mcp+llm+action"]["rows"] > rows["llm"]["rows"]
    assert len({(r["tp_rate"], r["top1"]) for r in rows.values()}) > 1  # the strategies are judged on their own rows
    assert rows["prefix+mcp"]["same_as"] == "mcp" and rows["prefix"]["same_as"] is None  # `mcp` names the tool too
    assert rows["prefix+mcp+negative"]["top1"] == rows["prefix+mcp"]["top1"] and rows["prefix+mcp+negative"]["gate"] == "cosine+negative"

    evaluated = subprocess.run([sys.executable, "-m", "sidecar", "eval", *labeled, "--json", "-q"], capture_output=True, text=True, env=env,
                               cwd=ROOT, timeout=600)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads(evaluated.stdout)
    tiered, auto = rows["tiered"], rows["tiered:auto"]
    assert (tiered["tp_rate"], tiered["fp_rate"], tiered["top1"]) == pytest.approx((report["gate"]["tp_rate"], report["gate"]["fp_rate"], report["ranking"]["top1"]))
    assert (tiered["threshold"], auto["threshold"]) == (report["thresholds"]["confirm"], report["thresholds"]["auto"]) and tiered["gate"] == "builtin"
    assert auto["tp_rate"] <= tiered["tp_rate"] and auto["fp_rate"] <= tiered["fp_rate"]

    beaten = lambda a, b: (a["tp_rate"] >= b["tp_rate"] and a["fp_rate"] <= b["fp_rate"] and a["top1"] >= b["top1"]  # noqa: E731
                           and (a["tp_rate"], a["fp_rate"], a["top1"]) != (b["tp_rate"], b["fp_rate"], b["top1"]))
    for r in rows.values():
        assert r["pareto"] == (not any(beaten(o, r) for o in rows.values() if o is not r)), r
    # max_tp (FP at most 5%): the most requests caught within the FP bound, then the best top-1
    feasible = [r for r in rows.values() if r["fp_rate"] <= 0.05 + 1e-12]
    best = max((r["tp_rate"], r["top1"]) for r in feasible)
    (winner,) = [r for r in rows.values() if r["winner"]]
    assert (winner["tp_rate"], winner["top1"]) == best and winner["pareto"]


def test_eval_embeds_each_text_once_for_every_figure_and_shows_what_follows_its_bar(labeled, tmp_path, capsys):
    """`eval` judges every text (one embedding each, which its latency figure times) and
    computes the baselines on those same vectors: a text is sent to the model once for all
    it prints (twice before: the baselines embedded every text again, ~3 of the 5 silent
    minutes after the bar on the README's quality row). What the baselines still embed, the
    tools' whole descriptions, shows a bar."""
    from collections import Counter

    from sidecar import config
    from sidecar.core.pipeline import from_config
    from sidecar.engine import Sidecar
    from sidecar.lab import evaluate

    cfg = config.load(env={}, overrides={("model", "name"): models.SMALL_MODEL, ("store",): str(tmp_path / "fresh.db"), ("catalogs",): [NOTES]})
    pipe = from_config(cfg, progress=False, calibration=False)  # no gate head to weigh the negative patterns: they block
    engine = Sidecar(cfg, pipe, pipe.store, None)
    items = evaluate.read_labeled(labeled, engine.catalog)
    sent: Counter[str] = Counter()
    embed = engine.pipeline.embedder.embed

    def counted(texts, kind="query", bulk=False):
        if kind == "query":
            sent.update(texts)
        return embed(texts, kind, bulk)

    engine.pipeline.embedder.embed = counted
    capsys.readouterr()
    scored = evaluate.score(engine, items)
    blocked = [i.text for i, v in zip(items, scored.vectors) if v is None]
    report = evaluate.report(engine, items, scored, progress=True)
    err = capsys.readouterr().err
    texts = {i.text for i in items}
    assert {t: sent[t] for t in texts} == dict.fromkeys(texts, 1), "every text embedded once as a query"
    assert blocked, "the set holds texts a negative pattern blocks unembedded: ranked all the same, and counted above"
    assert f"embedding {len(engine.catalog)} tool descriptions for the plain-cosine baseline" in err
    assert 0.5 <= report.gate_baseline.auroc <= 1 and {b.kind for b in report.baselines} == {"cosine", "bm25", "tfidf"}


def test_tune_fits_on_the_catalog_as_shipped_not_on_written_cases(tmp_path):
    """The gate judges a catalog without its written cases (`Pipeline.gate_views`), so `tune`
    fits on it too: a catalog the shipped packs cover (filesystem) tunes to the same
    calibration whether `[cases] fill` is on or off. Fitted on the pack-filled views, the
    corpus' head lost 15 points of held-out TP (docs/benchmarks.md)."""
    lines = []
    for line in (ROOT / "fixtures" / "corpus" / "servers" / "filesystem.jsonl").read_text(encoding="utf-8").splitlines():
        item = json.loads(line)
        listed = [item["expect"]] if isinstance(item["expect"], str) else item["expect"]
        own = [t.split("__", 1)[1] for t in listed or () if t.startswith("filesystem__")]
        if item["expect"] is None or own:
            lines.append({"text": item["text"], "expect": own or None, "source": item["source"]})
    labeled = tmp_path / "filesystem.jsonl"
    labeled.write_text("".join(json.dumps(x) + "\n" for x in lines[::2]), encoding="utf-8")
    off = tmp_path / "off.toml"
    off.write_text("[cases]\nfill = false\n", encoding="utf-8")
    fits = {}
    for name, extra in (("on", ()), ("off", ("--config", off))):
        cal = tmp_path / f"{name}.json"
        run = _cli("tune", "-q", *extra, "--model", models.SMALL_MODEL, "--catalog", CATALOGS / "filesystem.json", "--labeled", labeled,
                   "--heldout-fraction", "0", "--start", "none", "--out", cal, tmp_path=tmp_path)  # fmt: skip
        assert run.returncode == 0, run.stderr
        fits[name] = calibration.read(cal)
    assert fits["on"].ranker.weights == fits["off"].ranker.weights
    assert fits["on"].head.coef == pytest.approx(fits["off"].head.coef)
    assert fits["on"].thresholds == fits["off"].thresholds
