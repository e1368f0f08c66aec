"""Build the case packs shipped with the package from the written cases in fixtures/cases/.

    python bench/build_packs.py            # every server of fixtures/cases/servers/
    python bench/build_packs.py --check    # exit 1 when a shipped pack differs from a rebuild

For each `fixtures/cases/servers/<server>.json` ({"server", "tools": {name: {"requests",
"near_misses"}}}) the tools of `fixtures/catalogs/<server>.json` are looked up by name and keyed
by what they are (`casebook.tool_key`), so a pack never applies to a tool whose description or
schema changed. A written tool the catalog does not hold is an error.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import msgspec
import orjson

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar.core import catalog as catalog_mod  # noqa: E402
from sidecar.core.casebook import PACK_DIR, Pack, PackTool, clean, tool_key  # noqa: E402

WRITER = "claude (this project's development sessions, 2026-11-28), from each tool's definition alone"
PROMPT = "sidecar/learn/writer_prompt.md"


def build(written_file: pathlib.Path, catalogs: pathlib.Path) -> Pack:
    raw = orjson.loads(written_file.read_bytes())
    server = raw["server"]
    cat = catalog_mod.load([catalogs / f"{server}.json"])
    tools: list[PackTool] = []
    for name, body in raw["tools"].items():
        tool = cat.get(name)
        if tool is None:
            raise SystemExit(f"{written_file}: {name!r} is not a tool of {catalogs / (server + '.json')}")
        tools.append(PackTool(name, tool_key(tool), list(clean(body["requests"])), list(clean(body.get("near_misses", ())))))
    missing = [t.name for t in cat if t.name not in raw["tools"]]
    if missing:
        print(f"{server}: no cases written for {', '.join(missing)}", file=sys.stderr)
    return Pack(server, WRITER, PROMPT, tools)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--written", default=str(ROOT / "fixtures/cases/servers"))
    ap.add_argument("--catalogs", default=str(ROOT / "fixtures/catalogs"))
    ap.add_argument("--out", default=str(ROOT / "sidecar/core" / PACK_DIR))
    ap.add_argument("--check", action="store_true", help="compare with the shipped packs instead of writing")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    stale = 0
    for f in sorted(pathlib.Path(args.written).glob("*.json")):
        pack = build(f, pathlib.Path(args.catalogs))
        data = msgspec.json.format(msgspec.json.encode(pack), indent=1) + b"\n"
        target = out / f.name
        if args.check:
            if not target.exists() or target.read_bytes() != data:
                print(f"{target}: differs from a rebuild", file=sys.stderr)
                stale += 1
            continue
        target.write_bytes(data)
        print(f"{target.relative_to(ROOT)}: {len(pack.tools)} tools, {sum(len(t.cases) for t in pack.tools)} cases")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
