"""The `sidecar` command: a thin shell over the library. Each subcommand parses flags,
builds a Config, calls the library, and prints; nothing here decides anything."""

from __future__ import annotations

import argparse
import math
import collections
import os
import pathlib
import sys
import typing
from collections.abc import Callable, Sequence

import msgspec

from . import __version__, output, progress
from .core import models
from . import config as config_mod
from .core.calibration import CalibrationError
from .core.catalog import CatalogError
from .config import ConfigError
from .core.embed import EmbedError
from .core.patterns import PatternError
from .store import StoreError
from .learn.writer import WriterError

# Errors that are the user's to fix: one line on stderr, exit 2, no traceback.
USER_ERRORS = (ConfigError, CatalogError, PatternError, CalibrationError, EmbedError, StoreError, models.ProvisioningError, WriterError, ValueError, OSError)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (env SIDECAR_CONFIG)")
    p.add_argument("--catalog", metavar="FILE", action="append", help="MCP tools/list JSON file, or a dir of them; repeat to merge several (as server__tool)")
    p.add_argument("--model", metavar="NAME|PATH", help=f"embedding model (default {models.DEFAULT_MODEL}; NAME:q8_0 for a quantised variant; see `sidecar model list`)")
    p.add_argument("--calibration", metavar="FILE", help="thresholds fitted by `sidecar tune`")
    p.add_argument("--task-prefixes", choices=("auto", "on", "off"), help="the model's task prefixes (nomic: search_query: / "
                   "search_document:); auto (default): what the calibration in force was fitted with")
    p.add_argument("--store", metavar="PATH", help="SQLite file or postgresql:// URL (default: a SQLite file in the XDG data dir; env SIDECAR_STORE)")
    p.add_argument("--patterns", metavar="DIR", help="pattern directory (lists.txt, negative.txt, high.txt)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (loading, indexing, judging)")


def _print_json(obj: object) -> None:
    """One JSON document on stdout, newline-terminated (what every `--json` prints)."""
    sys.stdout.buffer.write(msgspec.json.encode(obj) + b"\n")


def _config(args: argparse.Namespace, extra: dict[tuple[str, ...], object] | None = None) -> config_mod.Config:
    return config_mod.load(
        args.config,
        overrides={
            ("catalogs",): args.catalog,
            ("model", "name"): args.model,
            ("model", "task_prefixes"): args.task_prefixes,
            ("calibration",): args.calibration,
            ("store",): args.store,
            ("gate", "patterns"): args.patterns,
            **(extra or {}),
        },
    )


def _apply_learned(engine, quiet: bool) -> None:
    """What the store learned from traffic (its lesson, the tools that go together), applied as
    `serve` and the proxy apply it when they start, so `detect`, `recommend` and `replay` rank
    and inject as the server does on the same store and catalog (tests/test_one_ranking.py)."""
    from .serve.learner import apply_learned, traffic_log

    if not quiet and engine.cfg.learn.traffic and engine.store is not None and (n := traffic_log(engine).count()):
        # A refit costs in proportion to the log (seconds for hundreds of examples): never a silent wait.
        print(f"sidecar: fitting what the store learned from {n} traffic examples, as serve does"
              " ([learn] traffic = false in the config skips it)", file=sys.stderr)  # fmt: skip
    learned = apply_learned(engine)
    if learned is not None and not quiet and (engine.pipeline.learned is not None or len(engine.sequences)):
        print(f"sidecar: applying what the store learned from {learned.examples} traffic examples"
              f" ({'a lesson' if engine.pipeline.learned is not None else 'no lesson'}, {len(engine.sequences)} tools that go with another)",
              file=sys.stderr)  # fmt: skip


def cmd_detect(args: argparse.Namespace) -> int:
    from .engine import Sidecar
    from .core.pipeline import Request

    text = " ".join(args.text) if args.text else sys.stdin.read()
    if not text.strip():
        raise ValueError("no text to judge: pass TEXT or pipe it on stdin")
    engine = Sidecar.open(_config(args), progress=not args.quiet)
    _apply_learned(engine, args.quiet)
    [judged] = engine.judge([Request(text, args.source)])
    injected = judged.inject(engine.cfg.server.margin_for(args.source))
    if args.json:
        pipe = engine.pipeline
        _print_json(output.detected(judged.decision, injected, pipe.embedder.name, *pipe.thresholds_in_force))
    else:
        print(output.describe(judged.decision, injected))
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    from .engine import Sidecar
    from .core.pipeline import Request
    from .recommend import Context

    query = " ".join(args.query) if args.query else sys.stdin.read()
    if not query.strip():
        raise ValueError("no query: pass QUERY or pipe it on stdin")
    engine = Sidecar.open(_config(args), progress=not args.quiet)
    _apply_learned(engine, args.quiet)
    rec = engine.rank(Request(query), args.top, context=Context(agent=args.agent), mode=args.mode)
    if args.json:
        _print_json({"query": rec.query, "results": output.recommended(rec.results)})
        return 0
    print(f"{rec.mode} ranking of {rec.candidates} candidate(s){f', variant {rec.variant}' if rec.variant else ''}:")
    for i, r in enumerate(rec.results, 1):
        print(f"{i:>2}. {r.tool}  relevance {r.relevance:.3f}  score {r.score:.3f}\n    {r.why}")
    for name, reason in list(rec.excluded.items())[:5]:
        print(f"    (left out {name}: {reason})")
    return 0


def cmd_learn(args: argparse.Namespace) -> int:
    """`learn`; with `--traffic` (or `--reset-traffic`) and no catalog anywhere, the store's
    traffic alone: the examples are kept by tool name, whatever catalog the server judged with."""
    from .core.catalog import Catalog
    from .engine import Sidecar
    from .recommend import learn

    cfg = _config(args)
    if (args.traffic or args.reset_traffic) and not args.logs and not cfg.catalogs:
        return _learn_traffic(args, Sidecar.open(cfg, catalog=Catalog([]), progress=not args.quiet))
    engine = Sidecar.open(cfg, progress=not args.quiet)
    if args.traffic or args.reset_traffic or args.logs:
        return _learn_traffic(args, engine)
    rows = engine.history.feedback()
    samples = learn.samples_from_feedback(engine.recommender, rows)
    if not samples:
        raise ValueError(f"no feedback with a selected tool and other candidates in the store ({len(rows)} feedback rows): "
                         "clients send `feedback` on injected tools")  # fmt: skip
    result = learn.tune(samples, start=cfg.recommend.weights, heldout_fraction=args.heldout_fraction)
    if args.json:
        _print_json({"samples": len(samples), "feedback": len(rows), "result": result})
        return 0
    held = (f", held-out MRR {result.heldout_mrr_before:.3f} -> {result.heldout_mrr_after:.3f} ({result.heldout})"
            if result.heldout_mrr_after is not None else "")  # fmt: skip
    print(f"{len(samples)} of {len(rows)} feedback rows replayed: training MRR {result.train_mrr_before:.3f} -> {result.train_mrr_after:.3f}{held}")
    print("[recommend.weights]  # put in the config to use them")
    for name, value in msgspec.structs.asdict(result.weights).items():
        print(f"{name} = {value:.3f}")
    return 0


def _learn_traffic(args: argparse.Namespace, engine) -> int:
    """`learn --traffic`: the examples the server recorded (and those read from chat logs with
    `--from`), and what learning from them would do now; `--reset-traffic` forgets them. With
    no catalog, the examples and the tools that go together: the lesson is fitted over a
    catalog's tools, so what it would do is judged only with one."""
    from .serve.learner import learn, learn_sequences, traffic_log
    from .learn.traffic import log_examples
    from .transcripts import read_transcripts

    tlog = traffic_log(engine)
    if args.reset_traffic:
        print(f"forgot {tlog.reset()} traffic examples")
        return 0
    if args.logs:
        limits = engine.cfg.server
        turns, examples = log_examples(engine.pipeline, read_transcripts(args.logs, engine.catalog), limits.span_words, limits.max_stream_chars)
        kept = tlog.add(examples)
        if not args.json:
            spans = sum(e.source == "llm" for e in examples)
            print(f"read {len(turns)} user turns and {spans} reply spans that called from {len(args.logs)} chat log(s): {kept} examples kept")
    summary = tlog.summary()
    if len(engine.catalog):
        lesson, outcome = learn(engine, tlog)
    else:
        learn_sequences(engine, tlog)
        lesson, outcome = None, None
    rules = [r for rs in engine.sequences.rules.values() for r in rs]
    if args.json:
        _print_json({"examples": summary, "fit": outcome, "in_use": lesson is not None,
                     "sequences": {"sessions": engine.sequences.sessions, "rules": rules}})  # fmt: skip
        return 0
    print(f"{summary['called']} turns followed by a call, {summary['silent']} by none, from {summary['sessions']} sessions")
    unit = rules[0].unit if rules else "sessions"
    print(f"{len(rules)} tools that go with another, from the calls of {engine.sequences.sessions} {unit}" + "".join(
        f"\n  {r.tool}: {r.why}" for r in sorted(rules, key=lambda r: -r.together)[:10]))  # fmt: skip
    for tool, n in list(summary["tools"].items())[:10]:
        print(f"  {n:5d}  {tool}")
    if outcome is None:
        print("no catalog given: what a refit would do is judged over a catalog's tools (add --catalog FILE to see it)")
        return 0
    cal, got = outcome.calibration, outcome.learned
    if outcome.reason and lesson is None and math.isnan(cal.recall):
        print(f"nothing learned: {outcome.reason}")
    else:
        print(f"out of fold: first tool right and fired {cal.recall:.1%} -> {got.recall:.1%}, precision {cal.precision:.1%} -> {got.precision:.1%}"
              f" ({'the server uses it' if lesson is not None else outcome.reason})")  # fmt: skip
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    from .store.metrics import MetricsStore
    from .store import open_store

    cfg = config_mod.load(args.config, overrides={("store",): args.store})
    path = cfg.store
    store = open_store(cfg.store)
    listing = MetricsStore(store, cfg.recommend.metrics_retention_days).listing(
        server=args.server, tool=args.tool, failing=args.failing, threshold=cfg.recommend.failing_threshold,
        min_calls=cfg.recommend.min_calls)
    if args.json:
        _print_json(listing)
        return 0
    if not listing.tools:
        print(f"no tool calls on record in {path}" + (" match" if args.tool or args.server or args.failing else ""))
        return 0
    print(f"{'tool':<40} {'calls':>6} {'ok':>6} {'failed':>6} {'avg ms':>8}  last error")
    for t in listing.tools:
        name = f"{t.server}__{t.tool}" if t.server else t.tool
        lat = "-" if t.avg_latency_ms is None else f"{t.avg_latency_ms:.0f}"
        print(f"{name:<40} {t.call_count:>6} {t.success_count:>6} {t.failure_count:>6} {lat:>8}  {(t.last_error or '')[:60]}")
    return 0


def cmd_servers(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from .mcp import config as mcp_config
    from .mcp.connections import ConnectionManager

    cfg = mcp_config.load(args.mcp_config)
    progress.log_to_stderr(logging.ERROR)

    async def run() -> list:
        async with ConnectionManager(cfg) as manager:  # starts preconnect_servers
            await (manager.connect_all() if args.connect else manager.preconnected())
            return manager.status()

    status = asyncio.run(run())
    if args.json:
        _print_json({"servers": status})
        return 0
    print(f"{'server':<24} {'state':<11} {'tools':>5}  {'connected at':<21} {'tools changed at':<21} last error")
    for s in status:
        tools = "-" if s.tools is None else str(s.tools)
        print(f"{s.name:<24} {s.state:<11} {tools:>5}  {s.connected_at or '-':<21} {s.tools_changed_at or '-':<21} {s.last_error or ''}")
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from .core import catalog as catalog_mod
    from .mcp import config as mcp_config
    from .mcp import server as mcp_server

    if args.mcp_config is None and not (args.savings and args.catalog):
        raise ValueError("give --config mcp.json (an mcpServers file); only --savings --catalog FILE does without")
    cfg = mcp_config.load(args.mcp_config) if args.mcp_config else None
    progress.log_to_stderr(logging.WARNING)  # stderr: stdout may be the wire
    if args.savings:
        extra = {str(path): [t.definition() for t in catalog_mod.load([path])] for path in args.catalog or []}
        report = asyncio.run(mcp_server.measure_savings(cfg, extra))
        if args.json:
            _print_json(report)
        else:
            from .mcp.savings import describe as describe_savings

            print(describe_savings(report))
        return 0
    from .store import open_store

    settings = config_mod.load(overrides={("model", "name"): args.model, ("store",): args.store})  # TOML from SIDECAR_CONFIG
    store = open_store(settings.store)
    http = (args.host, args.port) if args.http else None
    return asyncio.run(mcp_server.run(cfg, settings, store, http=http, announce=progress.note))


def _writable(path: str | None) -> None:
    """Refuse an output path that cannot be written before any work is done (a model load, a
    fit), rather than after it; the file itself is only written once there is something to write."""
    if not path:
        return
    target = pathlib.Path(path)
    folder = target.parent
    if target.is_dir():
        raise OSError(f"{path}: is a directory")
    if not folder.is_dir():
        raise OSError(f"{path}: no such directory: {folder}")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise OSError(f"{path}: not writable")


def cmd_eval(args: argparse.Namespace) -> int:
    from .lab import evaluate
    from .engine import Sidecar

    _writable(args.items)
    engine = Sidecar.open(_config(args), progress=not args.quiet, history=False)  # a labelled set has no call history
    items = evaluate.read_labeled(args.labeled, engine.catalog)
    scored = evaluate.score(engine, items, bar=progress.bar(len(items) + sum(i.positive for i in items), "evaluating", not args.quiet))
    report = evaluate.report(engine, items, scored, progress=not args.quiet)
    if args.items:
        rows = evaluate.outcomes(items, scored)
        with open(args.items, "wb") as out:
            out.writelines(msgspec.json.encode(row) + b"\n" for row in rows)
        tally = collections.Counter(row.verdict for row in rows)
        print(f"{len(rows)} items written to {args.items}: " + ", ".join(f"{v.replace('_', ' ')} {tally[v]}" for v in typing.get_args(evaluate.Verdict)), file=sys.stderr)
    if args.json:
        _print_json(report)
    else:
        print(evaluate.describe(report))
    return 0


def cmd_cascade(args: argparse.Namespace) -> int:
    from .lab import cascade, evaluate
    from .core import catalog as catalog_mod
    from .engine import Sidecar

    cfg = _config(args, {("cascade", "screen"): args.screen})
    if not cfg.cascade.screen:  # fitting a screen needs one: the small model unless told
        cfg = msgspec.structs.replace(cfg, cascade=msgspec.structs.replace(cfg.cascade, screen=models.SMALL_MODEL))
    if args.out_of_fold and args.reject_below is not None:
        raise ValueError("--out-of-fold fits a cutoff: give it without --reject-below")
    cat = catalog_mod.load(cfg.catalogs)
    items = evaluate.against_whole_catalog(evaluate.read_labeled(args.labeled, cat), "cascade")
    if args.out_of_fold:
        from .store import open_store

        say = None if args.quiet else (lambda m: print(f"sidecar: {m}", file=sys.stderr))
        fit = cascade.fit_out_of_fold(items, cat, cfg, open_store(cfg.store), args.max_loss, say)
        if args.json:
            _print_json({"screen": cfg.cascade.screen, "main": cfg.model.name, "out_of_fold": True, "max_loss": args.max_loss, "cutoff": fit})
        else:
            print(cascade.describe_outcome(fit, f"fitted out of fold, each text against the whole catalog and against a part of it, as `tune` "
                                                f"picks thresholds: settles at most {args.max_loss:.1%} of the positives the main model fires on"))
            print(f'[cascade]\nscreen = "{cfg.cascade.screen}"\nreject_below = {fit.reject_below:.4f}')
        return 0
    engine = Sidecar.open(cfg, catalog=cat, progress=not args.quiet, history=False)
    with progress.bar(2 * len(items), "judging with both models", not args.quiet) as bar:
        report = cascade.measure(engine, items, args.max_loss, args.reject_below, bar.update)
    if args.json:
        _print_json(report)
    else:
        print(cascade.describe(report))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from .core import catalog as catalog_mod
    from . import store as store_mod
    from .lab import tune
    from .lab.evaluate import from_transcripts, read_labeled
    from .transcripts import read_transcripts

    cfg = _config(args)
    if not args.labeled and not args.transcripts:
        raise ValueError("nothing to fit on: give --labeled FILE or --transcripts FILE (or both)")
    objective = tune.Objective.parse(args.objective)
    if not args.l2_embedding > 0:
        raise ValueError(f"--l2-embedding must be positive, not {args.l2_embedding}")
    if not 0.0 <= args.absent_share <= 1.0:
        raise ValueError(f"--absent-share must be within [0, 1], not {args.absent_share}")
    _writable(args.out)
    _writable(args.plot)
    if args.plot:
        from .lab import plot

        plot.require_matplotlib()
    cat = catalog_mod.load(cfg.catalogs)
    items = [i for path in args.labeled or () for i in read_labeled(path, cat)]
    if args.transcripts:
        items += from_transcripts(read_transcripts(args.transcripts, cat))
    store = store_mod.open_store(cfg.store)
    matrix = None
    if args.strategies:
        from .lab import strategies
        from .lab.evaluate import against_whole_catalog

        fit_part = [items[k] for k in tune.split(len(items), args.heldout_fraction, args.seed)[0]]
        matrix = strategies.matrix(against_whole_catalog(fit_part, "tune --strategies"), cat, cfg, store, objective,
                                   progress=None if args.quiet else progress.note)  # fmt: skip
        if not args.json:
            print(strategies.describe(matrix, objective), flush=True)
    fitted = tune.fit(items, cat, cfg, objective, args.heldout_fraction, args.seed, store,
                      progress=None if args.quiet else progress.note, l2_embedding=args.l2_embedding, start=args.start,
                      absent_share=args.absent_share)  # fmt: skip
    if args.out:
        tune.write_calibration(fitted, args.out)
    if args.plot:
        plot.gate_plot(fitted, args.plot)
    if args.json:
        ranker = fitted.calibration.ranker
        _print_json({"calibration": fitted.calibration.thresholds, "ranker": {"weights": ranker.weights, "adapter": ranker.adapter is not None},
                     "objective": fitted.objective,
                     "fit": fitted.fit, "heldout": fitted.heldout, "before": fitted.before, "before_origin": fitted.before_origin,
                     "seconds": fitted.seconds,
                     "start": fitted.start, "starts": fitted.starts, **({"matrix": matrix} if matrix is not None else {})})  # fmt: skip
    else:
        print(tune.describe(fitted))
        if args.out:
            print(f"calibration written to {args.out}")
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio

    from websockets.exceptions import WebSocketException

    from .core import catalog as catalog_mod
    from . import replay
    from .client import SidecarError
    from .engine import Sidecar

    cfg = _config(args)
    if args.url:  # the server has the model; the catalog, if given, only checks tool_calls
        conversations = replay.read_transcripts(args.transcripts, catalog_mod.load(cfg.catalogs) if cfg.catalogs else None)
    else:
        engine = Sidecar.open(cfg, progress=not args.quiet)
        conversations = replay.read_transcripts(args.transcripts, engine.catalog)
        _apply_learned(engine, args.quiet)
    total = sum(m.role != "tool" for c in conversations for m in c.messages)
    with progress.bar(total, "replaying", not args.quiet) as bar:
        if args.url:
            try:
                detections, summary = asyncio.run(replay.replay_url(args.url, conversations, token=cfg.server.token, on_message=lambda: bar.update(1)))
            except (SidecarError, WebSocketException) as e:  # the server refused, failed or went away: one line
                raise ValueError(f"replay --url {args.url}: {e}") from None
        else:
            detections, summary = replay.replay(engine, conversations, lambda: bar.update(1))
    if args.out:
        with open(args.out, "wb") as f:
            f.writelines(msgspec.json.encode(d) + b"\n" for d in detections)
    if args.json:
        _print_json(summary)
    else:
        print(replay.describe(summary))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from .core import catalog as catalog_mod
    from .serve import server
    from .store import open_store

    cfg = _config(args, {("server", "host"): args.host, ("server", "port"): args.port})
    cat = catalog_mod.load(cfg.catalogs) if cfg.catalogs else catalog_mod.Catalog([])  # fail before binding
    live = None
    if args.mcp_config is not None:
        from .mcp import config as mcp_config

        live = mcp_config.load(args.mcp_config)
    store = open_store(cfg.store)
    progress.log_to_stderr(logging.WARNING)

    if not cfg.catalogs and live is None:
        progress.note("no catalog given: sessions bring their tools in hello.tools")
    return asyncio.run(server.run(cfg, cat, store, progress.note, mcp=live, progress=not args.quiet))


def cmd_proxy(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from .core import catalog as catalog_mod
    from .proxy import app
    from .store import open_store

    cfg = _config(args, {("proxy", "upstream"): args.upstream, ("proxy", "host"): args.host, ("proxy", "port"): args.port,
                         ("proxy", "confirm_tools"): args.confirm_tools, ("proxy", "on_narration"): args.on_narration})  # fmt: skip
    if not cfg.proxy.upstream:
        raise ValueError("no upstream: give --upstream URL, the chat API's base URL (e.g. http://127.0.0.1:8000/v1)")
    cat = catalog_mod.load(cfg.catalogs) if cfg.catalogs else None  # fail before binding
    live = None
    if args.mcp_config is not None:
        from .mcp import config as mcp_config

        live = mcp_config.load(args.mcp_config)
    if cat is None and live is None:
        raise ValueError("no tools to add: give --mcp-config mcp.json (tools the proxy can run) and/or --catalog FILE")
    store = open_store(cfg.store)
    progress.log_to_stderr(logging.WARNING)

    return asyncio.run(app.run(cfg, cat, store, progress.note, mcp=live, progress=not args.quiet))


def _case_sources(args: argparse.Namespace):
    """The catalog as given (no cases filled in), its store, and the case book the pipeline
    would fill it from."""
    from .core import catalog as catalog_mod
    from .core.casebook import book_for
    from .store import open_store

    cfg = _config(args, {("cases", "writer"): getattr(args, "writer", None), ("cases", "writer_model"): getattr(args, "writer_model", None)})
    cat = catalog_mod.load(cfg.catalogs)
    store = open_store(cfg.store)
    return cfg, cat, store, book_for(store, cfg.cases.packs)


def cmd_cases_write(args: argparse.Namespace) -> int:
    from .core.casebook import keep, stored
    from .core.index import MIN_OWN_CASES
    from .learn import writer

    cfg, cat, store, book = _case_sources(args)
    if cfg.cases.writer is None:
        raise ValueError("no case writer: pass --writer openai:URL (with --writer-model) or gguf:PATH, or set [cases] writer")
    have = stored(store) if args.replace_packs else book
    todo = writer.lacking(cat, (lambda t: False) if args.force else (lambda t: have.get(t) is not None), MIN_OWN_CASES)
    if not todo:
        print(f"every tool of the catalog has cases ({len(cat)} tools): nothing to write (--force writes them again)")
        return 0
    chat = writer.open_chat(cfg.cases.writer, cfg.cases.writer_model, cfg.cases.key_env, cfg.cases.timeout_s)
    with progress.bar(len(todo), f"writing cases with {chat.spec}", enabled=not args.quiet) as bar:
        report = writer.write_cases(todo, chat, on_tool=lambda _t: bar.update(1))
    keep(store, report.written)
    if args.json:
        _print_json({"written": {t.name: {"cases": w.cases, "near_misses": w.near_misses} for t, w in report.written},
                     "failed": {t.name: e for t, e in report.failed}, "seconds": round(report.seconds, 2), "writer": chat.spec})
    else:
        for tool, w in report.written:
            print(f"{tool.name}:")
            for case in w.cases:
                print(f"    {case}")
        for tool, error in report.failed:
            print(f"failed: {error}", file=sys.stderr)
        per = report.seconds / max(1, len(todo))
        print(f"wrote cases for {len(report.written)} of {len(todo)} tools in {report.seconds:.1f} s ({per:.1f} s a tool); "
              f"{len(report.failed)} failed (those keep their descriptions alone); kept in {store.location}")
    store.close()
    return 1 if report.failed and not report.written else 0


def cmd_cases_show(args: argparse.Namespace) -> int:
    from .core.index import MIN_OWN_CASES

    cfg, cat, store, book = _case_sources(args)
    tools = list(cat)
    if args.tool:
        tools = [t for t in cat if t.name == args.tool or t.bare_name == args.tool]
        if not tools:
            raise ValueError(f"{args.tool!r} is not a tool of the catalog")
    rows = []
    for tool in tools:
        written = book.get(tool)
        own = list(tool.cases or ())
        used = written is not None and len(own) < MIN_OWN_CASES
        source = "catalog" if len(own) >= MIN_OWN_CASES else (written.origin if used else "description only")
        rows.append({"tool": tool.name, "source": source, "cases": own + (list(written.cases) if used else []),
                     "near_misses": list(written.near_misses) if used else [], "indexed": source == "catalog" or (used and cfg.cases.fill)})
    store.close()
    if args.json:
        _print_json(rows)
        return 0
    if not args.tool:
        for r in rows:
            print(f"{r['tool']:<48} {len(r['cases']):>3} cases  {r['source']}")
        covered = sum(1 for r in rows if r["source"] != "description only")
        print(f"{covered} of {len(rows)} tools have cases; `sidecar cases show TOOL` lists them, `sidecar cases write` writes the rest")
        if not cfg.cases.fill:
            print("[cases] fill = false: the index ranks on the catalog's own cases and descriptions alone")
        return 0
    for r in rows:
        print(f"{r['tool']} ({r['source']}):")
        for case in r["cases"]:
            print(f"    {case}")
        if r["near_misses"]:
            print("  near misses (the same nouns, no call for it):")
            for case in r["near_misses"]:
                print(f"    {case}")
    return 0


def cmd_model_pull(args: argparse.Namespace) -> int:
    names = list(models.KNOWN_MODELS) if args.name == "all" else [args.name]
    quants = models.pulled_quants()
    for name in names:
        path = models.pull(name, dest=args.dir or config_mod.load().model.dir, progress=True, force=args.force, quants=quants)
        print(f"{name}: {path}")
        if ":" not in name:
            for quant in quants:
                print(f"{name}:{quant}: {path.parent / models.variant_filename(models.KNOWN_MODELS[name], quant)}")
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    args.dir = args.dir or config_mod.load().model.dir
    present = {m.name: m for m in models.installed(args.dir)}

    def row(spec: models.ModelSpec) -> dict:
        m = present.pop(spec.name, None)
        return {"name": spec.name, "quant": spec.quant, "installed": m is not None, "path": m.path if m else None,
                "size": m.size if m else None, "default": spec.name == models.DEFAULT_MODEL,
                "loads": spec.quant == models.preferred_variant()}  # fmt: skip

    rows = []
    for name, spec in models.KNOWN_MODELS.items():
        variants = [row(v) for v in models.variants() if v.quant != "f16" and models.base_name(v.name) == name]
        rows.append({**row(spec), "license": spec.license, "source": spec.source, "variants": variants})
    for m in present.values():
        rows.append({"name": m.name, "quant": None, "installed": True, "path": m.path, "size": m.size, "default": False, "loads": False,
                     "license": None, "source": "local file", "variants": []})  # fmt: skip
    if args.json:
        _print_json({"dir": str(args.dir), "models": rows})
        return 0
    print(f"models in {args.dir}")
    for r in rows:
        for i, v in enumerate([r, *r["variants"]]):
            mark = "*" if v["default"] else " "
            state = f"{v['size'] / 1e6:.0f} MB" if v["installed"] else f"not pulled (sidecar model pull {v['name']})"
            loads = f"   ({r['name']} loads this here)" if i and v["loads"] else ""
            print(f"{mark} {'  ' if i else ''}{v['name']:<{30 if i else 32}} {state}{loads}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sidecar", description="Intent-detection sidecar: which tool does this text call for?")
    parser.add_argument("--version", action="version", version=f"sidecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("detect", help="judge one piece of text with the tiered gate")
    _common(p)
    p.add_argument("--source", choices=("user", "llm"), default="user", help="a user turn or LLM output (default user)")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.add_argument("text", nargs="*", help="the text (default: stdin)")
    p.set_defaults(func=cmd_detect)

    p = sub.add_parser("recommend", help="rank the catalog's tools for a query on relevance and call history")
    _common(p)
    p.add_argument("--agent", metavar="A", help="agent id: its A/B variant, its own success history")
    p.add_argument("--top", type=int, metavar="N", help="how many tools (default 5)")
    p.add_argument("--mode", choices=("semantic", "lexical", "hybrid"), help="retrieval (default: the config's recommend.mode, semantic)")
    p.add_argument("--json", action="store_true", help='print {"query", "results": [{"tool", "relevance", "score", "why", "factors"}]}')
    p.add_argument("query", nargs="*", help="the query (default: stdin)")
    p.set_defaults(func=cmd_recommend)

    p = sub.add_parser("learn", help="fit the recommender's weights to feedback; --traffic: what the server learns from its traffic")
    _common(p)
    p.add_argument("--traffic", action="store_true", help="show the user turns recorded to learn from and what learning from them does now")
    p.add_argument("--from", dest="logs", nargs="+", metavar="LOG", help="add the turns of chat logs (OpenAI, Anthropic, ours) to those examples")
    p.add_argument("--reset-traffic", action="store_true", help="forget every recorded traffic example")
    p.add_argument("--heldout-fraction", type=float, default=0.3, metavar="F", help="share of feedback kept out of fitting, to report (default 0.3)")
    p.add_argument("--json", action="store_true", help='print {"samples", "feedback", "result"}')
    p.set_defaults(func=cmd_learn)

    p = sub.add_parser("metrics", help="per-tool call history the server recorded")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (env SIDECAR_CONFIG)")
    p.add_argument("--store", metavar="PATH", help="SQLite file or postgresql:// URL (default: a SQLite file in the XDG data dir; env SIDECAR_STORE)")
    p.add_argument("--tool", metavar="T", help="one tool (its name, or server__tool)")
    p.add_argument("--server", metavar="S", help="one server's tools")
    p.add_argument("--failing", action="store_true", help="only tools whose success rate is under recommend.failing_threshold, over recommend.min_calls calls or more")
    p.add_argument("--json", action="store_true", help='print {"tools": [{"server", "tool", "call_count", ...}]}')
    p.set_defaults(func=cmd_metrics)

    p = sub.add_parser("servers", help="the MCP servers of an mcpServers JSON: state, tools, last error")
    p.add_argument("--mcp-config", "--config", dest="mcp_config", metavar="FILE", required=True,
                   help="mcpServers JSON as Claude Desktop / Cursor write it (here --config means this file, not the TOML)")
    p.add_argument("--connect", action="store_true", help="connect to every server first (default: only preconnect_servers)")
    p.add_argument("--json", action="store_true", help='print {"servers": [{"name", "state", "tools", "connected_at", "last_error", ...}]}')
    p.set_defaults(func=cmd_servers)

    p = sub.add_parser("mcp", help="serve find_tool, call_tool and keep_tools over MCP, for every server of an mcpServers JSON")
    p.add_argument("--mcp-config", "--config", dest="mcp_config", metavar="FILE",
                   help="mcpServers JSON (here --config means this file; the TOML comes from SIDECAR_CONFIG)")
    p.add_argument("--model", metavar="NAME|PATH", help=f"embedding model for find_tool (default {models.DEFAULT_MODEL})")
    p.add_argument("--store", metavar="PATH", help="SQLite file or postgresql:// URL: embeddings and the call metrics (default: a SQLite file in the XDG data dir; env SIDECAR_STORE)")
    p.add_argument("--http", action="store_true", help="serve streamable HTTP at /mcp instead of stdio")
    p.add_argument("--host", default="127.0.0.1", help="with --http: address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8766, help="with --http: port (default 8766, 0 for any free one)")
    p.add_argument("--savings", action="store_true", help="print the tokens of every tool schema vs the meta-tools + keep_tools, and exit")
    p.add_argument("--catalog", metavar="FILE", action="append", help="with --savings: also count a tools/list JSON file (repeat)")
    p.add_argument("--json", action="store_true", help="with --savings: print the figures as JSON")
    p.set_defaults(func=cmd_mcp)

    p = sub.add_parser("eval", help="measure the gate and the ranking on a labelled JSONL set")
    _common(p)
    p.add_argument("--labeled", metavar="FILE", required=True, help='JSONL: {"text", "expect": tool|[tools]|null, "source"}')
    p.add_argument("--json", action="store_true")
    p.add_argument("--items", metavar="FILE", help="also write one JSON line per item: its verdict (right, wrong_tool, missed, "
                   "false_fire, silent), the gate's probability and path, the tool injected first, the expected tool's rank")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("cascade", help="fit the cascade's cutoff: the screen probability under which a text is settled as no tool")
    _common(p)
    p.add_argument("--labeled", metavar="FILE", required=True, help='JSONL labelled set: {"text", "expect": tool|[tools]|null, "source"}')
    p.add_argument("--screen", metavar="NAME", help=f"the screen model (default: cascade.screen, else {models.SMALL_MODEL})")
    p.add_argument("--max-loss", type=float, default=0.01, metavar="X",
                   help="share of the positives the main model fires on that the cutoff may settle (default 0.01: one point)")
    p.add_argument("--reject-below", type=float, metavar="P", help="report this cutoff instead of fitting one")
    p.add_argument("--out-of-fold", action="store_true", help="the set the calibrations were fitted on: refit both gate heads as `tune` "
                   "does and fit the cutoff on their out-of-fold probabilities (the shipped cutoff comes from the corpus's fit part so)")
    p.add_argument("--json", action="store_true", help='print {"cutoff", "gate_main", "gate_cascade", "gate_screen", ...}')
    p.set_defaults(func=cmd_cascade)

    p = sub.add_parser("tune", help="fit the ranker, the gate head and its thresholds on labelled data")
    _common(p)
    p.add_argument("--labeled", metavar="FILE", action="append", help="JSONL labelled set (repeat to combine several)")
    p.add_argument("--transcripts", metavar="FILE", nargs="+", help="chat logs `replay` reads (OpenAI, Anthropic, ours) as labelled data: "
                   "each user turn expects the tools called before the next user turn, or none")
    p.add_argument("--strategies", action="store_true", help="first compare the design's strategies on the fit part: the index strategies "
                   "(base, prefix, mcp, llm, action, prefix+mcp and combinations) uncalibrated, prefix+mcp with the negative patterns "
                   "blocking, and the calibrated tiered gate: TP, FP, top-1, Pareto front, winner (--json: matrix)")
    p.add_argument("--objective", default="max_tp", help="max_tp (highest TP rate with FP <= 5%%), max_tp:fp<=0.02, balanced, f1")
    p.add_argument("--heldout-fraction", type=float, default=0.3, help="share of the labelled items kept out of fitting (default 0.3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--l2-embedding", type=float, default=1000.0, metavar="L2",
                   help="the gate head's L2 on the embedding's dimensions (default 1000; the scores get 1)")
    p.add_argument("--absent-share", type=float, default=0.0, metavar="X",
                   help="share of the requests also fitted as 'needs none' against a catalog without their tools (default 0): "
                   "for sets with no requests outside their catalog, when traffic will have them (docs/benchmarks.md)")
    p.add_argument("--start", choices=("auto", "none"), default="auto",
                   help="auto (default): where the model has a built-in calibration, also try the gate head pooled with its "
                   "exemplars, and pulled toward its head, keeping what does best out of fold; none: these texts alone")
    p.add_argument("--out", metavar="FILE", help="write the chosen calibration (JSON) for --calibration")
    p.add_argument("--plot", metavar="FILE.png", help="score distributions and the TP/FP sweep")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("replay", help="stream transcripts through the sidecar and score its injections")
    _common(p)
    p.add_argument("transcripts", nargs="+", metavar="TRANSCRIPT", help="OpenAI or Anthropic messages (JSON or JSONL), or our JSONL; detected per file")
    p.add_argument("--out", metavar="FILE", help="write every injection as JSONL")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--url", metavar="ws://HOST:PORT", help="replay through a running `sidecar serve` instead of in-process")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("serve", help="serve the streaming websocket protocol (docs/protocol.md)")
    _common(p)
    p.add_argument("--host", help="address to bind (default 127.0.0.1; env SIDECAR_HOST)")
    p.add_argument("--port", type=int, help="port (default 8765, 0 for any free one; env SIDECAR_PORT)")
    p.add_argument("--mcp-config", metavar="FILE", help="mcpServers JSON (as `sidecar mcp` reads it): index the live servers' tools "
                   "beside --catalog, follow their list changes, and withhold the tools of a server that is down")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("proxy", help="an OpenAI- and Anthropic-compatible endpoint (/v1/chat/completions, /v1/messages) in front of a chat API that adds "
                        "the injected tools and runs the MCP ones (docs/proxy.md)")
    _common(p)
    p.add_argument("--upstream", metavar="URL", help="the chat API's base URL, as the openai SDK's base_url (e.g. http://127.0.0.1:8000/v1, "
                        "https://api.anthropic.com/v1; env SIDECAR_UPSTREAM)")
    p.add_argument("--mcp-config", metavar="FILE", help="mcpServers JSON: their tools are injected and run by the proxy")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8766, 0 for any free one)")
    p.add_argument("--confirm-tools", choices=("include", "exclude"), help="add the tools of a confirm-tier inject too (default exclude: auto tier only)")
    p.add_argument("--on-narration", choices=("restart", "annotate", "off"), help="a reply narrating a tool it was not given: send the request "
                   "again with it (restart), name it in the stream (annotate, the default), or nothing (off)")
    p.set_defaults(func=cmd_proxy)

    cases = sub.add_parser("cases", help="example requests for tools whose catalog ships none: show them, or have an LLM write them").add_subparsers(
        dest="cases_command", required=True)  # fmt: skip
    p = cases.add_parser("show", help="each tool's cases and where they come from (catalog, a shipped pack, a writer); TOOL: its cases")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("tool", nargs="?", help="a tool's name (server__tool or as its server names it)")
    p.set_defaults(func=cmd_cases_show)
    p = cases.add_parser("write", help="have an LLM write cases for the tools that have none, kept in the store by tool content")
    _common(p)
    p.add_argument("--writer", metavar="SPEC", help="openai:URL (an OpenAI-compatible API; key from $OPENAI_API_KEY) or gguf:PATH (a local chat model)")
    p.add_argument("--writer-model", metavar="NAME", help="the model an openai: writer asks for")
    p.add_argument("--force", action="store_true", help="write again for tools that already have written cases")
    p.add_argument("--replace-packs", action="store_true", help="write for tools a shipped pack covers too")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cases_write)

    model = sub.add_parser("model", help="provision embedding models").add_subparsers(dest="model_command", required=True)
    p = model.add_parser("pull", help="fetch and verify a known model into the model dir, and write its variants (q8_0; bf16 where the CPU computes it)")
    p.add_argument("name", choices=[*(s.name for s in models.variants()), "all"], metavar="NAME[:QUANT]|all",
                   help=f"{', '.join(models.KNOWN_MODELS)}; NAME:QUANT ({', '.join(models.QUANTS)}) writes one variant")
    p.add_argument("--dir", help="model dir (default: XDG cache; env SIDECAR_MODELS_DIR)")
    p.add_argument("--force", action="store_true", help="fetch again even if present")
    p.set_defaults(func=cmd_model_pull)
    p = model.add_parser("list", help="known and installed models")
    p.add_argument("--dir", help="model dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_model_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except USER_ERRORS as e:
        print(f"sidecar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
