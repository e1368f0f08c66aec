"""The labelled corpus behind the built-in calibrations (fixtures/corpus/): every line well
formed and naming real tools, every tool of a corpus server asked for in both voices, and the
fit / held-out files exactly what bench/corpus_split.py writes from the per-server files (so a
calibration refitted from them is refitted from what docs/benchmarks.md describes)."""

from __future__ import annotations

import collections
import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fixtures" / "corpus"
NEGATIVE_KINDS = {"topic", "past", "offer", "explanation", "opinion", "hypothetical", "refusal", "result", "codegen"}
# the demo tools of the `everything` server have little to ask for: three requests each
FEWER = {"everything": 3}


def _lines() -> list[tuple[str, int, dict]]:
    out = []
    for f in sorted((CORPUS / "servers").glob("*.jsonl")):
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                out.append((f.stem, n, json.loads(line)))
    return out


@pytest.fixture(scope="module")
def lines():
    return _lines()


@pytest.fixture(scope="module")
def all_tools():
    return {t["name"] for t in json.loads((ROOT / "fixtures" / "catalogs" / "ALL.json").read_text(encoding="utf-8"))["tools"]}


def test_lines_are_well_formed_and_name_real_tools(lines, all_tools):
    seen: dict[str, tuple[str, int]] = {}
    for server, n, item in lines:
        where = f"servers/{server}.jsonl:{n}"
        assert (CORPUS.parent / "catalogs" / f"{server}.json").exists(), f"{where}: no catalog for {server}"
        assert item["source"] in ("user", "llm"), where
        if item["expect"] is None:
            assert set(item) == {"text", "expect", "source", "kind"} and item["kind"] in NEGATIVE_KINDS, where
        else:
            assert set(item) == {"text", "expect", "source"}, where
            listed = [item["expect"]] if isinstance(item["expect"], str) else item["expect"]
            assert listed and not set(listed) - all_tools, f"{where}: unknown tools {set(listed) - all_tools}"
        key = item["text"].casefold()
        assert key not in seen, f"{where}: same text as servers/{seen[key][0]}.jsonl:{seen[key][1]}"
        seen[key] = (server, n)


def test_every_tool_of_a_corpus_server_is_asked_for_by_users_and_in_replies(lines, all_tools):
    asked = collections.Counter()
    voices = collections.defaultdict(set)
    for server, _, item in lines:
        if item["expect"] is not None:
            for t in [item["expect"]] if isinstance(item["expect"], str) else item["expect"]:
                if t.split("__", 1)[0] == server:
                    asked[t] += 1
                    voices[t].add(item["source"])
    servers = {s for s, _, _ in lines}
    short = {t: asked[t] for t in sorted(all_tools) if t.split("__", 1)[0] in servers
             and (asked[t] < FEWER.get(t.split("__", 1)[0], 4) or voices[t] != {"user", "llm"})}
    assert not short, f"tools with too few requests or only one voice: {short}"


def test_fit_and_heldout_are_what_the_split_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("corpus_split", ROOT / "bench" / "corpus_split.py")
    split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(split)
    split.main(tmp_path)
    for name in ("fit.jsonl", "heldout.jsonl", "fit-catalog.json", "heldout-own.jsonl"):
        assert (tmp_path / name).read_bytes() == (CORPUS / name).read_bytes(), f"{name} is stale: run python bench/corpus_split.py"
    held = {json.loads(ln).get("group") for ln in (CORPUS / "heldout.jsonl").read_text(encoding="utf-8").splitlines()}
    fit = {json.loads(ln).get("group") for ln in (CORPUS / "fit.jsonl").read_text(encoding="utf-8").splitlines()}
    assert held - {None} and fit - {None} and not (held & fit) - {None}, "a server on both sides of the split"
