"""Load on the streaming server, per configuration: N concurrent streams at R tokens/s over
loopback, and the replay quality of the same configuration, side by side.

Each configuration (`--configs`; see CONFIGS) is a TOML file handed to both `sidecar serve`
and `sidecar replay`:

- `baseline`: the default model judging every clause: the query cache off
  (`index.query_cache = 0`) and every longer span of a growing clause judged
  (`server.rejudge_unchanged = true`);
- `default`: what ships (no key set);
- `minilm`: what ships, with the small model;
- `cascade`: the default model behind the MiniLM screen (`[cascade] screen`, with the shipped
  `reject_below`): only the texts the screen does not settle reach nomic.

For each, it starts `sidecar serve` on 127.0.0.1, opens N connections that each stream LLM
replies word by word at R tokens/s for `--duration` seconds, and measures:

- decision latency after a clause boundary, client side: from sending the token that
  completed the clause (the whitespace after its terminator) to receiving the `decision`
  message (hello.decisions opts in, so silent decisions are timed too);
- CPU use of the server process (process_cpu_seconds_total from /metrics, all threads;
  100% = one core);
- evaluations dropped under load (`stale` and `overflow`; `superseded` spans are counted
  apart: their newer span, which contains them, is judged);
- the decisions that waited for the model (`modelled`: not settled by a pattern; a reply's
  clause that commits to nothing is decided as it is cut) and their own p99 (`model p99`);
- the work it skipped: query cache hits and spans of growing clauses not judged again;
- throughput: spans judged (every decision, settled or not) per CPU-second of the server, and
  the share of the screened texts the cascade's screen settled.

It searches (doubling, then bisecting, up to `--max-streams`) for the largest N whose p99 is
at most `--target-ms` with nothing dropped: `capacity_streams`. Then it runs
`sidecar replay --json` over fixtures/transcripts/*.jsonl (catalog ALL.json) with the same
config for precision, recall and lead time.

The replies are clauses of the labelled corpus (reply-side texts) and of the transcripts,
shuffled with a fixed seed and handed out without replacement, so a configuration's cache
finds a repeat only once the pool is used up (the worst case for the cache; real replies
repeat openers more often): `cache_hit_rate` says how much it found. Every configuration
gets the same texts in the same order.

    .venv/bin/python bench/stream_load.py --json --duration 5 --max-streams 64 > out.json
    .venv/bin/python bench/stream_load.py --configs minilm --streams 1 8 32
    .venv/bin/python bench/stream_load.py --url ws://127.0.0.1:8765 --streams 16

Progress goes to stderr; with --json, stdout holds only the JSON list.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import math
import os
import pathlib
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import msgspec
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.core import models  # noqa: E402
from sidecar import protocol as p  # noqa: E402
from sidecar.client import SidecarClient, tokens  # noqa: E402
from sidecar.transcripts import read_transcripts  # noqa: E402

NOTES = ROOT / "fixtures" / "catalogs" / "notes.json"
ALL = ROOT / "fixtures" / "catalogs" / "ALL.json"
TRANSCRIPTS = sorted((ROOT / "fixtures" / "transcripts").glob("*.jsonl"))
CORPUS = [ROOT / "fixtures" / "corpus" / "fit.jsonl", ROOT / "fixtures" / "corpus" / "heldout.jsonl"]
CLAUSES_PER_REPLY = 5

# name -> the TOML it runs with (catalogs, store and port come from the command line)
CONFIGS = {
    "baseline": f'[model]\nname = "{models.DEFAULT_MODEL}"\n[index]\nquery_cache = 0\n[server]\nrejudge_unchanged = true\n'
                '[cascade]\nscreen = ""\n',
    "default": "",
    "one-thread": "[model]\nidle_cores = false\n",  # the default before a judgement took idle cores
    "f16": f'[model]\nname = "{models.DEFAULT_MODEL}:f16"\n',  # the default's f16 file where the default loads bf16
    "minilm": f'[model]\nname = "{models.SMALL_MODEL}"\n',
    "cascade": f'[model]\nname = "{models.DEFAULT_MODEL}"\n[cascade]\nscreen = "{models.SMALL_MODEL}"\n',
}
# Every client of the bench comes from 127.0.0.1: the per-address limit is opened to the global one.
OPEN_PER_ADDRESS = "max_connections_per_address = 256\n"


def config_text(name: str) -> str:
    """A configuration's TOML with the per-address limit opened (in its [server] table)."""
    text = CONFIGS[name]
    if "[server]\n" in text:
        return text.replace("[server]\n", "[server]\n" + OPEN_PER_ADDRESS, 1)
    return text + "[server]\n" + OPEN_PER_ADDRESS


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


class Item(msgspec.Struct):
    text: str
    source: str = "user"


def clause_pool(seed: int) -> list[str]:
    """Reply-side clauses: the corpus's `llm` texts and the transcripts' assistant sentences,
    each ending in a terminator (so each is a boundary), shuffled."""
    texts: list[str] = []
    for path in CORPUS:
        for line in path.read_bytes().splitlines():
            if line.strip():
                item = msgspec.json.decode(line, type=Item)
                if item.source == "llm":
                    texts.append(item.text)
    for conv in read_transcripts(TRANSCRIPTS, None):
        for m in conv.messages:
            if m.role == "assistant" and m.content:
                texts += re.split(r"(?<=[.!?])\s+", m.content)
    out = []
    for t in dict.fromkeys(" ".join(t.split()) for t in texts):
        if sum(c.isalnum() for c in t) >= 3:
            out.append(t if t[-1] in ".!?" else t + ".")
    random.Random(seed).shuffle(out)
    return out


class Workload:
    """Hands out clauses from the pool without replacement, to whichever stream needs the
    next one (cycling once the pool is used up)."""

    def __init__(self, pool: list[str]):
        self.pool = pool
        self.used = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        text = self.pool[self.used % len(self.pool)]
        self.used += 1
        return text


def replies(clauses: Workload):
    """Replies of CLAUSES_PER_REPLY clauses, the last one ended by a newline."""
    while True:
        yield " ".join(itertools.islice(clauses, CLAUSES_PER_REPLY)) + "\n"


class Run:
    """What one load run measured."""

    def __init__(self) -> None:
        self.client_ms: list[float] = []  # boundary-completing token sent -> decision received
        self.model_ms: list[float] = []  # the same, of the decisions a pattern did not settle (they waited for the model)
        self.server_ms: list[float] = []  # the decision's own latency_ms
        self.lag_ms: list[float] = []  # how late each token was sent against the schedule
        self.decisions = 0
        self.injects = 0
        self.tokens = 0
        self.cpu = 0.0
        self.dropped = 0.0
        self.superseded = 0.0
        self.hits = 0.0
        self.misses = 0.0
        self.unchanged = 0.0
        self.seconds = 0.0
        self.judged = 0.0  # spans judged (sidecar_detections_total, every tier and path)
        self.cpu_s = 0.0
        self.settled = 0.0  # texts the cascade's screen settled / passed on
        self.passed = 0.0


def boundary_char(text: str, end: int) -> int:
    """Index of the character whose arrival made the segmenter emit a span ending at `end`:
    the first whitespace at or after it (terminators and closers sit in between)."""
    i = end
    while i < len(text) and not text[i].isspace():
        i += 1
    return i


async def one_stream(url: str, idx: int, work: Workload, rate: float, t0: float, duration: float, run: Run, token: str | None) -> None:
    sc = await SidecarClient.connect(url, session=f"bench-{idx}", token=token, decisions=True)
    sent: dict[str, tuple[str, list[int], list[float]]] = {}  # stream id -> reply, token starts, send times
    done = asyncio.Event()

    async def read() -> None:
        async for msg in sc:
            now = time.perf_counter()
            if isinstance(msg, p.Inject):
                run.injects += 1
            elif isinstance(msg, p.DecisionReport):
                run.decisions += 1
                if msg.reason == "boundary" and msg.stream in sent:
                    text, starts, times = sent[msg.stream]
                    k = bisect.bisect_right(starts, boundary_char(text, msg.end)) - 1
                    run.client_ms.append((now - times[k]) * 1000)
                    if not msg.path.startswith("negative:"):
                        run.model_ms.append(run.client_ms[-1])
                    run.server_ms.append(msg.latency_ms)
            if done.is_set() and isinstance(msg, p.Pong):
                return

    reader = asyncio.create_task(read())
    step = 1.0 / rate
    due = t0 + random.random() * step  # streams out of phase, as real ones are
    for n, reply in enumerate(replies(work)):
        if due >= t0 + duration:
            break
        sid = f"s{idx}-{n}"
        pieces = tokens(reply)
        times: list[float] = []
        sent[sid] = (reply, [int(x) for x in np.cumsum([0] + [len(t) for t in pieces[:-1]])], times)
        for piece in pieces:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            run.lag_ms.append(max(0.0, now - due) * 1000)
            times.append(now)
            await sc.token(sid, piece)
            run.tokens += 1
            due += step
        await sc.end(sid)
    done.set()
    await sc.ping()
    try:
        await asyncio.wait_for(reader, 10)
    except TimeoutError:
        pass
    await sc.close()


def scrape(http: str, token: str | None) -> dict[str, float]:
    req = urllib.request.Request(http + "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def load(url: str, n: int, work: Workload, args, token: str | None) -> Run:
    http = "http" + url[2:]
    run = Run()
    before = await asyncio.to_thread(scrape, http, token)
    t0 = time.perf_counter() + 0.5 + n * 0.005  # connections open before the clock starts
    await asyncio.gather(*(one_stream(url, i, work, args.rate, t0, args.duration, run, token) for i in range(n)))
    run.seconds = time.perf_counter() - t0
    after = await asyncio.to_thread(scrape, http, token)
    run.cpu = delta(after, before, "process_cpu_seconds_total") / run.seconds
    drops = 'sidecar_dropped_evaluations_total{reason="%s"}'
    run.dropped = delta(after, before, drops % "stale") + delta(after, before, drops % "overflow")
    run.superseded = delta(after, before, drops % "superseded")
    run.hits = delta(after, before, "sidecar_query_cache_hits_total")
    run.misses = delta(after, before, "sidecar_query_cache_misses_total")
    run.unchanged = delta(after, before, "sidecar_spans_unchanged_total")
    run.cpu_s = delta(after, before, "process_cpu_seconds_total")
    run.judged = sum(delta(after, before, k) for k in after.keys() | before.keys() if k.startswith("sidecar_detections_total"))
    run.settled = delta(after, before, 'sidecar_cascade_texts_total{outcome="settled"}')
    run.passed = delta(after, before, 'sidecar_cascade_texts_total{outcome="passed"}')
    return run


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


class Summary:
    """Medians over repeated runs at one N."""

    def __init__(self, n: int, runs: list[Run]):
        med = statistics.median
        self.n = n
        self.p50 = med(pct(r.client_ms, 50) for r in runs)
        self.p99 = med(pct(r.client_ms, 99) for r in runs)
        self.srv_p50 = med(pct(r.server_ms, 50) for r in runs)
        self.srv_p99 = med(pct(r.server_ms, 99) for r in runs)
        self.cpu = med(r.cpu for r in runs)
        self.dropped = max(r.dropped for r in runs)
        self.superseded = med(r.superseded for r in runs)
        self.decisions = med(r.decisions for r in runs)
        self.lag_p99 = med(pct(r.lag_ms, 99) for r in runs)
        self.p99s = [pct(r.client_ms, 99) for r in runs]
        self.model_p99 = med(pct(r.model_ms, 99) for r in runs)
        self.model_share = med(len(r.model_ms) / len(r.client_ms) if r.client_ms else math.nan for r in runs)
        judged = sum(r.hits + r.misses for r in runs)
        self.cache_hit_rate = sum(r.hits for r in runs) / judged if judged else 0.0
        self.unchanged = med(r.unchanged for r in runs)
        self.tokens = med(r.tokens for r in runs)
        self.judged_per_cpu_s = med(r.judged / r.cpu_s if r.cpu_s else math.nan for r in runs)
        screened = sum(r.settled + r.passed for r in runs)
        self.settled_share = sum(r.settled for r in runs) / screened if screened else None

    def passes(self, target_ms: float) -> bool:
        return self.p99 <= target_ms and self.dropped == 0

    def row(self) -> str:
        p99s = "/".join(f"{x:.0f}" for x in self.p99s)
        return (f"{self.n:>5} {self.p50:>8.1f} {self.p99:>8.1f} {self.srv_p50:>8.1f} {self.srv_p99:>8.1f} "
                f"{self.cpu * 100:>6.0f}% {self.dropped:>7.0f} {self.superseded:>6.0f} {self.decisions:>9.0f} "
                f"{self.cache_hit_rate:>6.1%} {self.unchanged:>9.0f} {self.lag_p99:>8.1f} {self.judged_per_cpu_s:>12.1f} "
                f"{'-' if self.settled_share is None else format(self.settled_share, '.1%'):>7} {self.model_share:>8.1%} {self.model_p99:>9.1f}   {p99s}")  # fmt: skip

    def json(self) -> dict:
        r = _ms
        return {"streams": self.n, "p50_ms": r(self.p50), "p99_ms": r(self.p99), "server_p50_ms": r(self.srv_p50),
                "server_p99_ms": r(self.srv_p99), "cpu_pct": r(self.cpu * 100), "dropped": self.dropped,
                "superseded": self.superseded, "decisions": self.decisions, "tokens": self.tokens,
                "cache_hit_rate": round(self.cache_hit_rate, 4), "spans_unchanged": self.unchanged,
                "lag_p99_ms": r(self.lag_p99), "judged_per_cpu_s": r(self.judged_per_cpu_s),
                "settled_share": None if self.settled_share is None else round(self.settled_share, 4),
                "model_share": None if math.isnan(self.model_share) else round(self.model_share, 4), "model_p99_ms": r(self.model_p99)}  # fmt: skip


def _ms(x: float) -> float | None:
    """Rounded for the JSON; None for NaN (no boundary decision came)."""
    return None if math.isnan(x) else round(x, 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else round(a / b, 3)


HEADER = (f"{'N':>5} {'p50 ms':>8} {'p99 ms':>8} {'srv p50':>8} {'srv p99':>8} {'cpu':>7} {'dropped':>7} {'supers':>6} "
          f"{'decisions':>9} {'cache':>6} {'unchanged':>9} {'lag p99':>8} {'judged/cpu-s':>12} {'settled':>7} {'modelled':>8} {'model p99':>9}   p99 per run")  # fmt: skip


async def measure(url: str, n: int, work: Workload, args, token: str | None) -> Summary:
    runs = [await load(url, n, work, args, token) for _ in range(args.repeat)]
    s = Summary(n, runs)
    log(s.row())
    return s


async def search(url: str, work: Workload, args, token: str | None) -> tuple[int, list[Summary]]:
    """Largest N (up to --max-streams) that passes: double until it fails, then bisect."""
    rows: list[Summary] = []
    ok, bad, n = 0, None, 1
    while n <= args.max_streams:
        s = await measure(url, n, work, args, token)
        rows.append(s)
        if s.passes(args.target_ms):
            ok, n = n, n * 2
        else:
            bad = n
            break
    while bad is not None and bad - ok > max(1, ok // 8):
        mid = (ok + bad) // 2
        s = await measure(url, mid, work, args, token)
        rows.append(s)
        ok, bad = (mid, bad) if s.passes(args.target_ms) else (ok, mid)
    return ok, rows


def _cli(cfg: pathlib.Path, args) -> tuple[list[str], list[str]]:
    """The command and the options every `sidecar` call of a configuration shares."""
    return [sys.executable, "-m", "sidecar"], ["--config", str(cfg)] + (["--store", args.store] if args.store else [])


async def serve(cfg: pathlib.Path, args) -> tuple[asyncio.subprocess.Process, str]:
    env = {**os.environ, **({"SIDECAR_THREADS": str(args.threads)} if args.threads else {})}
    exe, common = _cli(cfg, args)
    proc = await asyncio.create_subprocess_exec(*exe, "serve", *common, "--port", "0", "--catalog", str(args.catalog),
                                                stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env)  # fmt: skip
    for _ in range(200):
        line = (await proc.stderr.readline()).decode()
        if found := re.search(r"listening on (ws://\S+)", line):
            asyncio.create_task(_drain(proc.stderr))
            return proc, found.group(1)
        if not line:
            break
    raise RuntimeError(f"sidecar serve did not start with {cfg}: {line.strip()}")


async def _drain(stream) -> None:
    while await stream.readline():
        pass


async def load_config(name: str, cfg: pathlib.Path | None, args) -> dict:
    """The load half of one configuration: its server, its search (or fixed N)."""
    proc = None
    url = args.url
    if url is None:
        proc, url = await serve(cfg, args)
    try:
        probe = await SidecarClient.connect(url, session="probe", token=args.token, wait_s=300)
        model = probe.ready.model
        await probe.close()
        work = Workload(clause_pool(args.seed))
        log(f"\n== {name}: {model} (threads: {args.threads or 'default'}), {args.rate:g} tokens/s per stream, "
            f"{args.duration:g} s per run, {args.repeat} run(s) per N ==")  # fmt: skip
        log(HEADER)
        if args.streams:
            rows = [await measure(url, n, work, args, args.token) for n in args.streams]
            passing = [s.n for s in rows if s.passes(args.target_ms)]
            best = max(passing, default=0)
        else:
            best, rows = await search(url, work, args, args.token)
            log(f"{name}: largest N with p99 <= {args.target_ms:g} ms and nothing dropped: {best}")
    finally:
        if proc is not None:
            proc.terminate()
            await proc.wait()
    at = next((s for s in rows if s.n == best), rows[0])  # the figures at capacity (at the first N when none passed)
    return {"config": name, "model": model, "capacity_streams": best, "p50_ms": at.json()["p50_ms"], "p99_ms": at.json()["p99_ms"],
            "cpu_pct": at.json()["cpu_pct"], "at_streams": at.n, "runs": [s.json() for s in rows]}  # fmt: skip


def replay(cfg: pathlib.Path, args) -> dict:
    """`sidecar replay --json` over the transcripts with this configuration."""
    exe, common = _cli(cfg, args)
    t0 = time.perf_counter()
    out = subprocess.run([*exe, "replay", *map(str, TRANSCRIPTS), "--catalog", str(ALL), *common, "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=1800, check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"sidecar replay failed: {out.stderr.strip()[-500:]}")
    s = json.loads(out.stdout)
    return {"precision": s["precision"], "recall": s["recall"], "false_fires": s["false_fires"], "injections": s["injections"],
            "lead_time_chars": s["lead_time_chars"], "lead_time_tokens": s["lead_time_tokens"],
            "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def ratios(results: list[dict]) -> None:
    """Each configuration's figures over the baseline's of the same run (the machine is shared:
    absolute timings move with its load, ratios less)."""
    base = next((r for r in results if r["config"] == "baseline"), None)
    if base is None:
        return
    b1 = base["runs"][0]  # the first N measured, the same for every config
    for r in results:
        r1 = r["runs"][0]
        r["vs_baseline"] = {
            "capacity_streams": _ratio(r["capacity_streams"], base["capacity_streams"]),
            "p50_ms_at_first_n": _ratio(r1["p50_ms"], b1["p50_ms"]),
            "p99_ms_at_first_n": _ratio(r1["p99_ms"], b1["p99_ms"]),
            "cpu_pct_at_first_n": _ratio(r1["cpu_pct"], b1["cpu_pct"]),
            "judged_per_cpu_s_at_first_n": _ratio(r1["judged_per_cpu_s"], b1["judged_per_cpu_s"]),
        }
        # throughput at the largest N both measured (the search visits different Ns per config)
        mine, theirs = {x["streams"]: x for x in r["runs"]}, {x["streams"]: x for x in base["runs"]}
        if common := max(mine.keys() & theirs.keys(), default=None):
            r["vs_baseline"]["judged_per_cpu_s_at_n"] = {"streams": common, "ratio": _ratio(mine[common]["judged_per_cpu_s"],
                                                                                            theirs[common]["judged_per_cpu_s"])}  # fmt: skip
        if "replay" in r and "replay" in base:
            r["vs_baseline"]["precision_points"] = round(100 * (r["replay"]["precision"] - base["replay"]["precision"]), 1)
            r["vs_baseline"]["recall_points"] = round(100 * (r["replay"]["recall"] - base["replay"]["recall"]), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="configurations to measure (default: all)")
    ap.add_argument("--json", action="store_true", help="print a JSON list, one object per configuration, on stdout")
    ap.add_argument("--url", help="measure a running sidecar instead (no configurations, no replay)")
    ap.add_argument("--streams", type=int, nargs="+", help="fixed N values (default: search for the largest passing N)")
    ap.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream (default 50)")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per run (default 5)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per N; medians are reported (default 1)")
    ap.add_argument("--target-ms", type=float, default=50.0)
    ap.add_argument("--max-streams", type=int, default=64, help="the search stops here (default 64)")
    ap.add_argument("--catalog", type=pathlib.Path, default=NOTES, help="the server's catalog under load (default notes.json)")
    ap.add_argument("--store", help="the store both commands use (default: the CLI's; it caches the tools' embeddings)")
    ap.add_argument("--no-replay", action="store_true", help="skip the replay half")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--token", help="the server's shared token, with --url")
    ap.add_argument("--threads", type=int, help="llama.cpp threads of the servers it starts (SIDECAR_THREADS; default: the config's)")
    args = ap.parse_args()
    if args.url and args.url.split(":")[1].strip("/") not in ("127.0.0.1", "localhost", "[::1]"):
        ap.error("loopback only: --url must be ws://127.0.0.1:PORT")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["url"] if args.url else args.configs:
            cfg = None
            if not args.url:
                cfg = pathlib.Path(tmp) / f"{name}.toml"
                cfg.write_text(config_text(name))
            result = asyncio.run(load_config(name, cfg, args))
            if cfg is not None and not args.no_replay:
                log(f"{name}: replaying {len(TRANSCRIPTS)} transcripts on ALL.json ...")
                result["replay"] = replay(cfg, args)
                log(f"{name}: replay {result['replay']}")
            results.append(result)
    ratios(results)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            log(f"{r['config']}: capacity {r['capacity_streams']} streams; at N={r['at_streams']}: p50 {r['p50_ms']} / p99 {r['p99_ms']} ms, "
                f"cpu {r['cpu_pct']}%; replay {r.get('replay')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
