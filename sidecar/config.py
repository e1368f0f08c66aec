"""Configuration in one typed place: defaults < TOML file < environment < command-line flags.

Everything is validated when loaded, so a typo in a key or a threshold out of range stops
start-up with a message naming the key, instead of surfacing mid-conversation.
"""

from __future__ import annotations

import os
import pathlib
import tomllib
from typing import Any, Literal

import msgspec

from .core import models
from . import protocol
from .core.cases import Strategy
from .recommend.scoring import IntentRules, Priors, Weights


class ConfigError(ValueError):
    pass


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True):
    # A known model name, NAME:QUANT for a variant (models.QUANTS: "bf16", "q8_0", "q4_k_m";
    # "f16": the file as shipped; a plain name loads models.preferred_variant()), or a path to
    # a GGUF file.
    name: str = models.DEFAULT_MODEL
    dir: str | None = None  # where pulled models live (default: XDG cache)
    threads: int | None = None  # llama.cpp threads (default: all cores but one; see embed.default_threads)
    bulk_threads: int | None = None  # threads for index builds and tunes of 256+ texts (default: every core)
    # a judgement takes bulk_threads while no other process uses the cores (0.3 s of
    # /proc/stat), no catalog is being embedded beside it and the model's calls take 20 ms
    # or more: cores.CoreWatch, embed.Embedder.first_threads
    idle_cores: bool = True
    # numpy's BLAS threads in the serving processes (serve, proxy, mcp); 0: numpy's default, a
    # thread per core, which spin between calls (telemetry.limit_blas_threads)
    blas_threads: int = 1
    task_prefixes: Literal["auto", "on", "off"] = "auto"  # auto: the model's measured default
    pull: bool = True  # provision a known model (or quantise its variant) on first use

    def __post_init__(self) -> None:
        models.check_name(self.name)  # a known model's unknown variant fails at load
        if self.blas_threads < 0:
            raise ValueError(f"model.blas_threads={self.blas_threads} must be 0 (numpy's default) or more")


class GateConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Explicit threshold overrides; unset ones come from the model's calibration."""

    high: float | None = None
    fallback: float | None = None
    auto: float | None = None
    confirm: float | None = None
    patterns: str | None = None  # directory with lists.txt, negative.txt, high.txt
    regex_timeout_ms: float = 20.0
    # The model's replies: "commit" fires only where the text commits to an action (a
    # high-confidence pattern: "let me check ...", "I'll look up ..."); "any" judges every
    # span as a user turn is judged (questions, results and summaries fired too: docs/benchmarks.md).
    replies: Literal["commit", "any"] = "commit"
    # Log-odds added to a user turn's P(needs a tool) once the session's model has called a
    # tool (a tool_result came): people who are using tools go on asking for them. 0.82 is
    # what tau-bench airline's first half says (45% of turns after a call are followed by
    # one, 27% before); 0: a turn is judged alone.
    after_call: float = 0.82

    def __post_init__(self) -> None:
        if not 0 <= self.after_call <= 5:
            raise ValueError(f"gate.after_call={self.after_call} must be within [0, 5] (log-odds; 0 = off)")
        if not 0 < self.regex_timeout_ms <= 10_000:
            raise ValueError(f"gate.regex_timeout_ms={self.regex_timeout_ms} must be within (0, 10000]: at 0 every negative pattern times out and blocks")


class IndexConfig(msgspec.Struct, forbid_unknown_fields=True):
    user_strategy: str | None = None  # unset: the model's calibrated one (else base)
    llm_strategy: str | None = None  # unset: the model's calibrated one (else base)
    top_k: int = 5
    # Query embeddings kept for texts seen before (LRU; 0: off): a repeated text is not
    # embedded again. Memory: about dim x 4 bytes + the text per entry (docs/configuration.md).
    query_cache: int = 2048
    # A catalog whose tools carry their own cases fits its own gate and ranker weights from them
    # when indexed (sidecar/learn/selffit.py), where the built-in calibration is in force.
    self_fit: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.query_cache <= 1_000_000:
            raise ValueError(f"index.query_cache={self.query_cache} must be within 0..1000000")
        for key in ("user_strategy", "llm_strategy"):
            if getattr(self, key) is not None:
                Strategy.parse(getattr(self, key))  # raises with the list of modifiers
        if not 1 <= self.top_k <= 100:
            raise ValueError(f"index.top_k={self.top_k} must be within 1..100")


class CasesConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Example requests for tools whose catalog ships none (sidecar/core/casebook.py)."""

    # Add written cases (packs, and what `sidecar cases write` kept in the store) to tools with
    # fewer than five of their own; false: descriptions alone. serve and proxy are ready on the
    # descriptions and add them in the background (seconds when the store holds their vectors)
    fill: bool = True
    packs: bool = True  # the case packs shipped for widely used MCP servers (matched by tool content)
    # Who writes cases for tools no pack covers (`sidecar cases write`): "openai:URL" (any
    # OpenAI-compatible chat API; the key from the environment variable `key_env`) or
    # "gguf:PATH" (a local model through llama-cpp-python: a chat model, or a base model written
    # to by few-shot completion when its GGUF has no chat template); none: no writer
    writer: str | None = None
    writer_model: str | None = None  # the model name an OpenAI-compatible API is asked for
    key_env: str = "OPENAI_API_KEY"
    timeout_s: float = 60.0  # per tool

    def __post_init__(self) -> None:
        if self.writer is not None and not (self.writer == "openai" or self.writer.startswith(("openai:", "gguf:"))):
            raise ValueError(f"cases.writer={self.writer!r} must be 'openai:URL', 'openai' (the proxy's upstream) or 'gguf:PATH'")
        if self.writer is not None and self.writer.startswith("openai") and not self.writer_model:
            raise ValueError("cases.writer_model is needed with an openai writer: the model the API is asked for")
        if not 1 <= self.timeout_s <= 600:
            raise ValueError(f"cases.timeout_s={self.timeout_s} must be within 1..600")


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`sidecar serve`: where it listens, who may connect, and the limits that keep one
    misbehaving client from costing the others."""

    host: str = "127.0.0.1"  # loopback unless asked otherwise
    port: int = 8765  # 0: any free port
    token: str | None = None  # shared secret: Authorization: Bearer TOKEN or ?token=TOKEN
    origins: list[str] = []  # allowed Origin headers (browsers); empty: any
    max_frame_bytes: int = 1 << 20  # a larger frame closes the connection with 1009
    # Commas and opening brackets outside strings one frame may hold (`too_many_values`
    # beyond), counted before it is decoded: decoding builds every value first, 0.1-0.2 us
    # each. The 128 largest real tools hold about 11,000; raise it with max_hello_tools.
    max_frame_values: int = protocol.MAX_VALUES
    # Frames the websocket library reads ahead of the handler per connection (then reading
    # pauses): memory per connection is about this x max_frame_bytes, and a client that left
    # is noticed only once what was read ahead is worked through (reading paused, the kernel
    # does not report the close).
    read_ahead_frames: int = 2
    # The event loop's fair share: each connection's frames are read at this many characters a
    # second on average, in bursts of up to twice max_frame_bytes; a connection past it is not
    # read until its budget refills (its frames wait in its socket, and the kernel holds back
    # its sender). A megabyte frame costs the event loop a few milliseconds however it fails.
    read_chars_per_s: int = 1 << 20
    max_stream_chars: int = 512  # text buffered per stream; a longer clause is judged and cut
    max_streams: int = 64  # open streams per connection
    closed_streams: int = 32  # ended streams a connection remembers (which tools each got), ~0.5 KB each
    max_connections: int = 256
    # Connections one peer address may hold at once (a quarter of max_connections' default):
    # a single host cannot take every place. Loopback clients count too; behind a reverse proxy
    # every client has the proxy's address, so raise it there (docs/deploy.md).
    max_connections_per_address: int = 64
    span_words: int = 12  # judge a clause after this many words with no boundary
    # A longer user turn is judged on its first and last halves of this many characters: one
    # turn's work on the model thread is bounded (a 100,000-character turn took 490 ms of it).
    max_turn_chars: int = 4096
    # A growing clause is judged again only when it gained content words (not for a trailing
    # comma, space or stopword); true: every longer span is judged (the every-clause baseline).
    rejudge_unchanged: bool = False
    max_pending: int = 4096  # queued evaluations; beyond it the oldest are dropped
    stale_ms: float = 2000.0  # an evaluation that waited longer is dropped
    # Overload: when what waits would take the model longer than this (estimated from its
    # measured cost per character), whole streams are shed, the most loaded connection's first,
    # so the streams kept are answered within about this instead of every stream late.
    shed_ms: float = 500.0
    # ... replies' spans first, and user turns only while what is left would take longer than
    # shed_turns_ms (shed_ms if that is more): a turn is what the chat app waits on, and shed it
    # gets no tool at all.
    # With blocked spans settled on the event loop (settle_ms) the queue holds only spans the
    # model must embed, and at 500 ms a 1,000-connection soak on nomic lost 25-46 of 595 probe
    # turns (bench/soak.py).
    shed_turns_ms: float = 1000.0
    # Also inject runners-up within this relevance of the best. Chosen on Seal-Tools' tuning
    # split (0.05 -> 0.03: recall of the called tools 88.1% -> 87.9%, precision 71.0% -> 74.6%).
    inject_margin: float = 0.03
    # The same for a span of the model's reply: 0, its best tool alone. A reply fires as it
    # commits ("I'll start", "let me pull up"), on a few words that rank close tools near-tied:
    # its runners-up were right for 8 of 36 tools (tau airline both halves, the in-house
    # transcripts; the best tool 46 of 104), a user turn's runners-up 13 of 118 (tau's second
    # half), but much of BFCL multi-turn's recall, whose turns ask for several steps: user
    # turns keep inject_margin.
    reply_margin: float = 0.0
    max_inject_tools: int = 3
    # Tools one session keeps in the model's context at once (0: no bound). Past it an inject
    # names in `drop` the tools to take out: first the oldest never called (no tool_result),
    # then the oldest called. A tool dropped is injected again when a later stream asks for it.
    context_tools: int = 0
    split_asks: bool = True  # a user turn of several asks also injects the best tool of each ask that needs one (sidecar/core/asks.py)
    shutdown_timeout_s: float = 10.0  # finishing in-flight work on SIGTERM
    # Backpressure: spans, `end`s and store writes one connection may have waiting; at this
    # many the sidecar stops reading its frames until the model thread takes them. A
    # connection holds at most about 2 x this x max_stream_chars characters of span text
    # (what waits, and the batch being judged): 256 KiB at the defaults, plus the
    # read_ahead_frames frames the websocket library reads ahead. One token frame makes at most
    # this many spans (too_many_spans beyond: the rest of the frame is not read).
    max_queued_per_connection: int = 256
    # The longest value of each client-given string kept in the metrics store, in characters
    # (every row carries them: an uncapped one multiplies the disk it costs).
    max_agent_chars: int = 128  # hello.agent, on every call and feedback row
    max_query_chars: int = 1000  # feedback.query
    max_error_chars: int = 500  # tool_result.error
    max_name_chars: int = 256  # tool and server names (hello.tools may define long ones)
    # Fairness between connections (issue 13 D). The model thread judges one batch at a time;
    # a batch takes spans round-robin, one per connection in turn, and stops at
    # max_batch_spans or at about max_batch_ms of estimated work (the model's measured cost
    # per character), so another connection's span waits at most about one batch.
    max_batch_spans: int = 64
    max_batch_ms: float = 250.0
    # ... but while two or more connections have spans waiting or were answered within the last
    # second, one of them light (at most one span waiting) and one busy, a batch stops at about
    # shared_batch_ms, and ("between") a hello's new tools are embedded about that much
    # estimated work a job: a light connection's span that arrives while a busy one's batch is
    # judged waits about this, not max_batch_ms (issue 33). A lone stream, and connections
    # all light or all busy, keep the big batches.
    shared_batch_ms: float = 15.0
    # A span the patterns block (a reply's clause that commits to no action: most of a
    # stream's) is decided on the event loop as it is cut, when each pattern set's searches
    # take at most settle_ms of CPU time; it waits for no batch of embeddings on the model
    # thread. A text that takes longer (or 0: every span) is judged there as before.
    settle_ms: float = 2.0
    # hello.tools may define at most this many new tools. "beside": they are embedded on a
    # second context of the model (its own threads, loaded at the first such hello), beside the
    # judging, so no session's span waits behind another's catalog; "between": on the model
    # thread, catalog_slice_tools at a time between batches (no second context's memory, but a
    # span can wait for one slice: a single tool's long text is ~95 ms of MiniLM).
    max_hello_tools: int = 128
    hello_embed: Literal["beside", "between"] = "beside"
    # A user turn longer than max_stream_chars (longer than any streamed span) is embedded
    # first on the second context ("beside"; its connection's next frames wait for it), so
    # the model thread only scores it: a 512-token turn took 80-130 ms of MiniLM that every
    # other session's span waited behind. "inline": judged on the model thread like any span.
    long_turn_embed: Literal["beside", "inline"] = "beside"
    catalog_slice_tools: int = 8
    session_catalogs: int = 16  # session catalogs (hello.tools) kept built, most recent first
    # Delivery (issue 13 C): at outbox_messages queued for a client the sidecar stops reading
    # its frames until it drains (flow control; the messages already produced still go out).
    # A client that takes no message for send_timeout_s while messages wait is closed with 1013.
    # The outbox stays under outbox_messages + 4 x max_queued_per_connection + 64 messages
    # (what the work already read can still produce); reaching that also closes with 1013.
    outbox_messages: int = 1024
    send_timeout_s: float = 10.0
    # Store contention (issue 13 J): a tool_result / feedback write waits at most this long for
    # SQLite's write lock (held by another process on the same file) or PostgreSQL's row locks
    # (another replica), retrying without blocking the model thread's reads; past it the
    # client gets `store_busy`.
    store_busy_timeout_ms: float = 2000.0
    # Silent connections (issue 33): one that sends no hello within hello_timeout_s is closed
    # (1008), one that then sends nothing for idle_timeout_s too (1001); a silent connection
    # would otherwise hold one of max_connections for ever.
    hello_timeout_s: float = 10.0
    idle_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port={self.port} must be within 0..65535")
        positive = ("max_frame_bytes", "max_frame_values", "read_ahead_frames", "read_chars_per_s", "max_stream_chars", "max_streams", "closed_streams", "max_connections", "max_connections_per_address", "span_words", "max_turn_chars",
                    "max_pending", "stale_ms", "shed_ms", "shed_turns_ms", "max_inject_tools", "shutdown_timeout_s", "max_queued_per_connection",
                    "max_agent_chars", "max_query_chars", "max_error_chars", "max_name_chars")  # fmt: skip
        for key in positive:
            if getattr(self, key) <= 0:
                raise ValueError(f"server.{key}={getattr(self, key)} must be positive")
        if not 0 <= self.context_tools <= 10_000:
            raise ValueError(f"server.context_tools={self.context_tools} must be within 0..10000 (0: no bound)")
        if self.max_turn_chars < 64:
            raise ValueError(f"server.max_turn_chars={self.max_turn_chars} must be at least 64")
        if not 0 <= self.settle_ms <= 50:
            raise ValueError(f"server.settle_ms={self.settle_ms} must be within 0..50 (CPU milliseconds of the event loop a span; 0: off)")
        if self.max_stream_chars < 16:
            raise ValueError(f"server.max_stream_chars={self.max_stream_chars} must be at least 16")
        for key in ("inject_margin", "reply_margin"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"server.{key}={getattr(self, key)} must be within 0..1")
        if self.token is not None and not self.token.strip():
            raise ValueError("server.token is empty: unset it or give a secret")
        for key in ("max_batch_spans", "max_batch_ms", "shared_batch_ms", "max_hello_tools", "catalog_slice_tools", "session_catalogs", "outbox_messages",
                    "send_timeout_s", "store_busy_timeout_ms", "hello_timeout_s", "idle_timeout_s"):  # fmt: skip
            if getattr(self, key) <= 0:
                raise ValueError(f"server.{key}={getattr(self, key)} must be positive")

    def margin_for(self, source: str) -> float:
        """How close to the best tool a runner-up must rank to be injected with it, for a text of `source`."""
        return self.reply_margin if source == "llm" else self.inject_margin


class RecommendConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The recommender and the metrics it learns from (`sidecar recommend`, `sidecar metrics`)."""

    mode: Literal["semantic", "lexical", "hybrid"] = "semantic"  # semantic: the pipeline's fitted blend, BM25 included
    top: int = 5
    weights: Weights = msgspec.field(default_factory=Weights)  # relevance, success, popularity, performance, rating
    variants: dict[str, Weights] = {}  # A/B arms, assigned by sha256(agent id); empty: everyone gets `weights`
    priors: Priors = msgspec.field(default_factory=Priors)  # history factors until a tool has min_calls
    min_calls: int = 3
    intent: IntentRules = msgspec.field(default_factory=IntentRules)
    semantic_share: float = 0.7  # hybrid relevance = share x semantic + (1 - share) x BM25
    candidates: int = 20  # per retriever: vector, BM25, inverted indexes
    cache_ttl_s: float = 60.0  # 0: no cache
    cache_size: int = 1024  # rankings kept cached
    metrics_retention_days: int = 7  # raw call log; older calls live on as daily totals
    failing_threshold: float = 0.5  # success rate under which `metrics --failing` lists a tool
    max_fallbacks: int = 3
    same_server_boost: float = 1.25  # fallbacks on the failed tool's own server
    availability_window_s: float = 300.0  # a server is unavailable when its recent calls mostly fail
    availability_min_calls: int = 5
    availability_failure_rate: float = 0.8
    # A server counts as failing for everyone only when failures came from at least this many
    # distinct connections in the window; below it, only for the agent whose own calls failed.
    availability_min_reporters: int = 3
    rate_limit_calls: int | None = None  # per agent and tool within rate_limit_window_s; None: no limit
    rate_limit_window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.top <= 100:
            raise ValueError(f"recommend.top={self.top} must be within 1..100")
        for key in ("min_calls", "candidates", "metrics_retention_days", "max_fallbacks", "availability_min_calls", "cache_size",
                    "availability_min_reporters"):  # fmt: skip
            if getattr(self, key) < 1:
                raise ValueError(f"recommend.{key}={getattr(self, key)} must be at least 1")
        for key in ("semantic_share", "failing_threshold", "availability_failure_rate"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"recommend.{key}={getattr(self, key)} must be within 0..1")
        for key in ("cache_ttl_s", "availability_window_s", "rate_limit_window_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"recommend.{key}={getattr(self, key)} must not be negative")
        if self.same_server_boost < 1.0:
            raise ValueError(f"recommend.same_server_boost={self.same_server_boost} must be at least 1")
        if self.rate_limit_calls is not None and self.rate_limit_calls < 1:
            raise ValueError(f"recommend.rate_limit_calls={self.rate_limit_calls} must be at least 1 (or unset)")


class LearnConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`sidecar serve` learning from its traffic (sidecar/learn/traffic.py): each user turn on the
    server's catalog with the tools called after it (`tool_result`), or none, is an example;
    the catalog refits its lesson as they arrive and uses it only when it judges them better
    out of fold than the calibration alone."""

    traffic: bool = True  # record examples and learn from them; false: neither
    max_examples: int = 5000  # kept in the store, the oldest dropped first (about 1.6 KB each with nomic)
    session_share: float = 0.1  # of max_examples one connection may hold: no one client steers the lesson
    refit_every: int = 50  # new examples between refits (a refit is numpy, off the model thread)
    refit_share: float = 0.1  # of the time refits may take: after one of T seconds, none for T * (1 / share - 1)
    # What a lesson's bar is chosen for, among the bars at the calibration's precision or above
    # (out of fold): "recall", the most of it; "f1", the balance of recall and precision. Where
    # the calibration's precision is low, "recall" fires on nearly every turn (tau-bench
    # airline's first half: recall 0.687 at precision 0.295; "f1": 0.591 at 0.501).
    objective: Literal["recall", "f1"] = "recall"

    def __post_init__(self) -> None:
        if not 20 <= self.max_examples <= 100_000:
            raise ValueError(f"learn.max_examples={self.max_examples} must be within 20..100000")
        if not 0 < self.session_share <= 1:
            raise ValueError(f"learn.session_share={self.session_share} must be within (0, 1]")
        if not 1 <= self.refit_every <= 100_000:
            raise ValueError(f"learn.refit_every={self.refit_every} must be within 1..100000")
        if not 0 < self.refit_share <= 1:
            raise ValueError(f"learn.refit_share={self.refit_share} must be within (0, 1]")


class CascadeConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A cheap first stage: the `screen` model (with its built-in calibration) settles the
    texts it is sure need no tool, so only the rest reach the main model (sidecar/engine.py; its cutoff is fitted by `sidecar cascade`)."""

    screen: str = ""  # a known model (or NAME:QUANT) judging every text first; "": off
    # Screen probability under which a text on the fallback path is settled as "no tool"
    # without the main model (never a high-pattern text). Fitted for MiniLM before nomic with
    # `sidecar cascade --out-of-fold` on the corpus's fit part; on the held-out servers it cost
    # 1.7 points of TP, so the cascade ships off (docs/benchmarks.md, "The cascade").
    reject_below: float = 0.2607

    def __post_init__(self) -> None:
        if self.screen:  # a known model: a probability cutoff needs its built-in gate head
            base, quant = models.split(self.screen)
            if base not in models.KNOWN_MODELS or quant not in models.VARIANTS:
                raise ValueError(f"cascade.screen={self.screen!r} must be a known model or NAME:QUANT "
                                 f"({', '.join(models.KNOWN_MODELS)}), or \"\" for no cascade")  # fmt: skip
        if not 0.0 <= self.reject_below <= 1.0:
            raise ValueError(f"cascade.reject_below={self.reject_below} must be a probability within 0..1")


class ProxyConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`sidecar proxy`: an OpenAI- and Anthropic-compatible endpoint in front of an upstream chat API, which
    adds the tools the engine injects to each request (docs/proxy.md)."""

    upstream: str | None = None  # the upstream's base URL, e.g. http://127.0.0.1:8000/v1 (required by `sidecar proxy`)
    host: str = "127.0.0.1"  # loopback unless asked otherwise
    port: int = 8766  # 0: any free port
    # Which of the gate's tiers add tools: an auto-tier inject always does (unless the request's
    # tool_choice is "none"); a confirm-tier one only with "include".
    confirm_tools: Literal["include", "exclude"] = "exclude"
    # A reply that narrates an action needing a tool it was not given: "annotate" names the tools
    # in the stream (an SSE comment and a chunk with a `sidecar` field), "restart" stops the
    # upstream call and sends it again with the tools added, "off" only reads.
    on_narration: Literal["restart", "annotate", "off"] = "annotate"
    max_restarts: int = 1  # restarts per request with on_narration = "restart"
    max_tool_rounds: int = 4  # upstream calls answered with injected MCP tools' results per request
    connect_timeout_s: float = 10.0  # reaching the upstream (past it: 502)
    read_timeout_s: float = 300.0  # the upstream's silence, between bytes (past it: 504)
    max_body_bytes: int = 8 << 20  # a larger request body gets 413
    max_tool_result_chars: int = 20_000  # an MCP tool's result handed to the model is cut here
    # A `find_tools` tool the proxy offers and answers itself (the model searches the catalog when
    # the inject missed): on "always" every request the proxy may add tools to, on "when_none"
    # those it added no injected tool to, or "never".
    find_tools: Literal["always", "when_none", "never"] = "always"
    max_searches: int = 2  # find_tools calls the proxy answers per request (then it is no longer offered)
    find_tools_top: int = 5  # tools one search adds (best first)

    def __post_init__(self) -> None:
        if self.upstream is not None and not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"proxy.upstream={self.upstream!r} must be an http:// or https:// URL")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"proxy.port={self.port} must be within 0..65535")
        if self.max_restarts < 0:
            raise ValueError(f"proxy.max_restarts={self.max_restarts} must not be negative")
        for key in ("max_tool_rounds", "connect_timeout_s", "read_timeout_s", "max_body_bytes", "max_tool_result_chars", "max_searches",
                    "find_tools_top"):
            if getattr(self, key) <= 0:
                raise ValueError(f"proxy.{key}={getattr(self, key)} must be positive")


class Config(msgspec.Struct, forbid_unknown_fields=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    gate: GateConfig = msgspec.field(default_factory=GateConfig)
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    cases: CasesConfig = msgspec.field(default_factory=CasesConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    recommend: RecommendConfig = msgspec.field(default_factory=RecommendConfig)
    cascade: CascadeConfig = msgspec.field(default_factory=CascadeConfig)
    learn: LearnConfig = msgspec.field(default_factory=LearnConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    catalogs: list[str] = []
    store: str | None = None  # SQLite file (default: XDG data dir) or postgresql://user@host/db (shared by replicas)
    calibration: str | None = None  # file written by `sidecar tune`


# Environment variables and the config keys they set.
ENV = {
    "SIDECAR_MODEL": ("model", "name"),
    "SIDECAR_MODELS_DIR": ("model", "dir"),
    "SIDECAR_THREADS": ("model", "threads"),
    "SIDECAR_BULK_THREADS": ("model", "bulk_threads"),
    "SIDECAR_BLAS_THREADS": ("model", "blas_threads"),
    "SIDECAR_STORE": ("store",),
    "SIDECAR_CALIBRATION": ("calibration",),
    "SIDECAR_PATTERNS": ("gate", "patterns"),
    "SIDECAR_HOST": ("server", "host"),
    "SIDECAR_PORT": ("server", "port"),
    "SIDECAR_TOKEN": ("server", "token"),
    "SIDECAR_UPSTREAM": ("proxy", "upstream"),
}
_INTEGERS = ("threads", "bulk_threads", "blas_threads", "port")  # env values converted when they are digits


def _set(tree: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def load(path: str | os.PathLike | None = None, env: dict[str, str] | None = None, overrides: dict[tuple[str, ...], Any] | None = None) -> Config:
    """Build the configuration. `overrides` maps key paths to flag values (None = flag not given)."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    path = path or env.get("SIDECAR_CONFIG")
    if path:
        try:
            tree = tomllib.loads(pathlib.Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
    for var, keys in ENV.items():
        if env.get(var):
            _set(tree, keys, int(env[var]) if keys[-1] in _INTEGERS and env[var].isdigit() else env[var])
    for keys, value in (overrides or {}).items():
        if value is not None:
            _set(tree, keys, value)
    if not tree.get("store"):
        from .store import default_path

        tree["store"] = str(default_path(env.get("XDG_DATA_HOME")))
    if isinstance(model := tree.setdefault("model", {}), dict) and not model.get("dir"):
        from .core.models import models_dir

        model["dir"] = str(models_dir(env.get("XDG_CACHE_HOME")))
    try:
        return msgspec.convert(tree, Config)
    except (msgspec.ValidationError, ValueError) as e:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}invalid configuration: {e}") from None
