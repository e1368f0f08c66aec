"""Write the corpus's fit and held-out parts (fixtures/corpus/{fit,heldout}.jsonl), the
catalog of the servers in the fit part (fixtures/corpus/fit-catalog.json), and the held-out
part as a user with one server sees it (fixtures/corpus/heldout-own.jsonl): each line offers
only the tools of one server (`offered`, read by `sidecar eval`), the server its request is
for (and any other tool it lists as right) or the server its talk is about; general talk
offers a hash-picked held-out server's tools.

The held-out part is catalog-disjoint: whole servers, picked by a hash of their name, never
seen in fitting (neither their tools nor any text about them), plus a hash-picked 30% of the
"no tool" texts. Each server's lines carry `"group": <server>`, so `tune` holds a server's
requests and the talk written about it out together. Re-running gives the same files byte
for byte.

    python bench/corpus_split.py [OUT_DIR]      (default: fixtures/corpus)
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fixtures" / "corpus"
HELD_SHARE = 0.3


def share(key: str) -> float:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 2**32


def grouped(line: str, server: str, held: set[str] = frozenset()) -> str | None:
    """A server's line with its group, and with expected tools of `held` servers taken out of
    its list (None when nothing is left): fitting must not see those servers at all."""
    item = json.loads(line)
    expect = item["expect"]
    if expect is not None:
        listed = [expect] if isinstance(expect, str) else expect
        keep = [t for t in listed if t.split("__")[0] not in held]
        if not keep:
            return None
        if keep != listed:
            item["expect"] = keep[0] if len(keep) == 1 else keep
    return json.dumps(item | {"group": server}, ensure_ascii=False)


def own_server(line: str, names: dict[str, list[str]], held: list[str]) -> str:
    """A held-out line offering one server's tools (see the module's docstring)."""
    item = json.loads(line)
    expect = item["expect"]
    listed = [] if expect is None else [expect] if isinstance(expect, str) else expect
    server = item.get("group") or held[int(share("own" + item["text"]) * len(held))]
    offered = names[server] + [t for t in listed if t not in names[server]]
    return json.dumps(item | {"offered": offered}, ensure_ascii=False)


def main(out: pathlib.Path = CORPUS) -> None:
    catalogs = ROOT / "fixtures" / "catalogs"
    servers = sorted(p.stem for p in (CORPUS / "servers").glob("*.jsonl"))
    held = {s for s in servers if share("srv" + s) < HELD_SHARE}
    fit_lines: list[str] = []
    held_lines: list[str] = []
    for s in servers:
        lines = (CORPUS / "servers" / f"{s}.jsonl").read_text(encoding="utf-8").splitlines()
        if s in held:
            held_lines.extend(filter(None, (grouped(ln, s) for ln in lines if ln.strip())))
        else:
            fit_lines.extend(filter(None, (grouped(ln, s, held) for ln in lines if ln.strip())))
    for ln in (CORPUS / "notool.jsonl").read_text(encoding="utf-8").splitlines():
        if ln.strip():
            (held_lines if share("nt" + json.loads(ln)["text"]) < HELD_SHARE else fit_lines).append(ln)
    (out / "fit.jsonl").write_text("\n".join(fit_lines) + "\n", encoding="utf-8")
    (out / "heldout.jsonl").write_text("\n".join(held_lines) + "\n", encoding="utf-8")
    tools = []
    names: dict[str, list[str]] = {}
    for s in servers:
        doc = json.loads((catalogs / f"{s}.json").read_text(encoding="utf-8"))
        names[s] = [f"{s}__{t['name']}" for t in doc["tools"]]
        if s not in held:
            tools += [{"name": f"{s}__{t['name']}", "description": t.get("description", ""), "inputSchema": t.get("inputSchema", {})} for t in doc["tools"]]
    (out / "fit-catalog.json").write_text(json.dumps({"tools": tools}, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "heldout-own.jsonl").write_text("\n".join(own_server(ln, names, sorted(held)) for ln in held_lines) + "\n", encoding="utf-8")
    print(f"held-out servers: {', '.join(sorted(held))}")
    print(f"fit: {len(fit_lines)} items, {len(tools)} tools; held out: {len(held_lines)} items")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else CORPUS)
