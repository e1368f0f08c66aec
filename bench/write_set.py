"""Write cases for an outside set's catalog with a case writer and keep them in
fixtures/cases/sets/, as written and sifted, with the writer, its prompt and settings (issue 48).

    python bench/write_set.py --catalog CATALOG --set NAME --label LABEL --writer gguf:PATH|gguf:NAME|openai:URL

writes fixtures/cases/sets/NAME.LABEL-raw.json (every request the writer wrote that parses,
cleaned: `writer.write_cases`) and NAME.LABEL.json (what `writer.sift` keeps of them with the
configured embedding model: no request written for two tools, none the embedding places
nearer another tool's description). `bench/written_cases.py --also LABEL --also LABEL-raw`
judges them. Time per tool is wall and CPU seconds of this process (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidecar import config  # noqa: E402
from sidecar.core import catalog as catalog_mod  # noqa: E402
from sidecar.core.models import file_sha256  # noqa: E402
from sidecar.core.pipeline import open_embedder  # noqa: E402
from sidecar.learn import writer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--catalog", required=True, type=pathlib.Path)
    ap.add_argument("--set", required=True, help="the set's name: fixtures/cases/sets/SET.LABEL.json")
    ap.add_argument("--label", required=True)
    ap.add_argument("--writer", required=True)
    ap.add_argument("--writer-model")
    ap.add_argument("--threads", type=int, default=1, help="a gguf writer's threads (1: on 2 busy cores a second one spins, 2x slower)")
    args = ap.parse_args()

    cfg = config.load(None)
    cat = catalog_mod.load([args.catalog])
    tools = list(cat)
    kind, _, where = args.writer.partition(":")
    if kind == "gguf":
        path = where
        chat = writer.GgufChat(path, threads=args.threads)
    else:
        chat = writer.open_chat(args.writer, args.writer_model, cfg.cases.key_env, cfg.cases.timeout_s)
    per_tool: dict[str, dict] = {}
    written, failed = [], {}
    for tool in tools:
        w0, c0 = time.perf_counter(), time.process_time()
        report = writer.write_cases([tool], chat)
        per_tool[tool.name] = {"wall_s": round(time.perf_counter() - w0, 2), "cpu_s": round(time.process_time() - c0, 2)}
        written += report.written
        failed.update({t.name: e for t, e in report.failed})
        print(f"{tool.name}: {len(report.written[0][1].cases) if report.written else 0} requests, "
              f"{per_tool[tool.name]['wall_s']} s", file=sys.stderr, flush=True)  # fmt: skip
    embedder = open_embedder(cfg, None)
    sifted = writer.sift(written, tools, embedder)
    walls = [v["wall_s"] for v in per_tool.values()]
    cpus = [v["cpu_s"] for v in per_tool.values()]
    few_shot = not getattr(chat, "chat", True)
    record = {
        "writer": f"gguf:{pathlib.Path(path).name}" if kind == "gguf" else chat.spec,
        "mode": "few-shot completion (sidecar/learn/writer_fewshot.txt + writer.few_shot_prompt)" if few_shot
                else "chat (sidecar/learn/writer_prompt.md)",  # fmt: skip
        "model_sha256": file_sha256(path) if kind == "gguf" else None,
        "sampling": {**writer.GgufChat.SAMPLING, "seeds": list(range(writer.FEW_SHOT_ROUNDS)), "want": writer.FEW_SHOT_WANT,
                     "max_tokens": 240, "threads": args.threads} if few_shot else None,  # fmt: skip
        "catalog": str(args.catalog.name),
        "tools": len(tools),
        "written": len(written),
        "failed": failed,
        "seconds_per_tool": {"wall_mean": round(sum(walls) / len(walls), 2), "cpu_mean": round(sum(cpus) / len(cpus), 2),
                             "wall_max": max(walls)},  # fmt: skip
        "sift": {"embedding_model": embedder.name, "repeated": sifted.repeated, "misplaced": sifted.misplaced,
                 "tools_emptied": [t.name for t in sifted.emptied]},  # fmt: skip
    }
    out = ROOT / "fixtures" / "cases" / "sets"
    for suffix, items, note in ((f"{args.label}-raw", written, "as written (parsed and cleaned, not sifted)"),
                                (args.label, sifted.kept, "sifted: writer.sift with the embedding model")):  # fmt: skip
        data = {"server": args.set, "cases": note, "record": record,
                "tools": {t.name: {"requests": list(w.cases), "near_misses": list(w.near_misses)} for t, w in items}}  # fmt: skip
        (out / f"{args.set}.{suffix}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
