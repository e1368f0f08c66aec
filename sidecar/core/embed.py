"""Text embeddings from a GGUF model through llama.cpp.

llama-cpp-python's `embed()` returns raw (unnormalised) vectors and silently cuts input
at `n_batch` tokens. We normalise every vector and cut over-long text ourselves, saying
so, because a gate that judged half a message without knowing it is wrong silently.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from typing import Literal

import msgspec
import numpy as np

from sidecar import progress
from sidecar.core import cores

Kind = Literal["query", "document"]


class EmbedError(RuntimeError):
    """The model cannot be loaded or cannot embed."""


class Embedded(msgspec.Struct):
    vectors: np.ndarray  # (n, dim) float32, unit rows
    truncated: list[bool]


UNQUANTISED = frozenset({0, 1, 32})  # GGUF general.file_type: all F32, mostly F16, mostly BF16
_PARAMS = threading.Lock()  # one load at a time swaps llama-cpp-python's default model params


@functools.cache
def system_info() -> str:
    """What llama.cpp says it was built with and found on this CPU ("AVX512_BF16 = 1 | ..."):
    what it will compute with, where the CPU's own flags say only what exists."""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode("utf-8", "replace")


def repack_crashes(metadata: dict[str, str], amx_int8: bool | None = None) -> bool:
    """Whether llama.cpp's extra (repacked) CPU buffer types must stay off for a model whose
    GGUF metadata this is: with them, a quantised embedding model segfaults in encode where
    llama.cpp runs int8 products on AMX (`amx_int8`; default: whether this build does, by
    `system_info`). llama-cpp-python 0.3.36, Xeon Sapphire Rapids: `all-minilm-l6-v2:q8_0`
    and nomic's Q8_0 alike; without them they embed as they should."""
    try:
        file_type = int(metadata.get("general.file_type", 0))
    except ValueError:
        return False
    if file_type in UNQUANTISED:
        return False
    return "AMX_INT8 = 1" in system_info() if amx_int8 is None else amx_int8


@contextlib.contextmanager
def _without_extra_buffers():
    """Meanwhile, `Llama(...)` loads with `use_extra_bufts` false. Its constructor takes no such
    argument: it starts from `llama_model_default_params()`, which is swapped for the load."""
    import llama_cpp.llama_cpp as lib

    if "use_extra_bufts" not in dict(lib.llama_model_params._fields_):
        yield
        return
    default = lib.llama_model_default_params

    def without():
        params = default()
        params.use_extra_bufts = False
        return params

    with _PARAMS:
        lib.llama_model_default_params = without
        try:
            yield
        finally:
            lib.llama_model_default_params = default


MAX_CTX = 8192  # tokens: no text the sidecar judges or indexes is longer
PROBE_CTX = 512  # a model of unknown context is first loaded at this, then at its own


def default_threads() -> int:
    """All cores but one. llama.cpp's threads wait for each other by spinning, so when they
    compete with the event loop, the chat app beside us or other processes, a step stalls
    on its slowest thread: on 2 busy cores one thread gave a MiniLM phrase p50 9 ms / max
    12 ms where two gave p50 41 ms / max 1.4 s (docs/protocol.md, "Performance")."""
    return max(1, (os.cpu_count() or 1) - 1)


BULK_TEXTS = 256  # a job of this many texts is throughput work (an index build, a tune)
IDLE_S = 2.0  # the first context unused this long (no traffic): a job beside it may take every core
LONG_CALL_S = 0.02  # a model whose judgements take this long gains from idle cores:
# nomic's clause (40-90 ms) went p99 108 -> 61 ms on two threads, MiniLM's (5-10 ms) lost to
# the threads' syncing, p99 20 -> 34-47 ms (docs/benchmarks.md, "Streaming capacity")
BESIDE_PIECE = 4  # texts a job beside embeds before it looks again (a judgement that starts
# meanwhile shares the cores with at most one piece: ~0.1 s of nomic on both)


def bulk_threads() -> int:
    """Every core: a bulk job (thousands of tool texts before serving starts) has no latency
    to protect, and two threads embed it 1.85x faster than one (MiniLM, 192 tool
    descriptions in calls of 64, idle machine)."""
    return max(1, os.cpu_count() or 1)


class Embedder:
    """One loaded model. llama.cpp contexts are not thread-safe, so calls take a lock."""

    def __init__(
        self,
        path: str,
        *,
        name: str,
        identity: str,
        threads: int | None = None,
        bulk: int | None = None,
        prefixes: tuple[str, str] | None = None,
        max_tokens: int | None = None,
        flash_attn: bool = True,
        idle_cores: bool = False,
    ):
        if not os.path.isfile(path):
            raise EmbedError(f"model file not found: {path}")
        try:
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise EmbedError(f"cannot load model {path}: not a GGUF file")
        except OSError as e:
            raise EmbedError(f"cannot load model {path}: {e.strerror or e}") from None
        threads = threads or default_threads()
        # The trained context comes from the loaded model (reading it from the header with
        # gguf's reader parsed the whole vocabulary first: 4-5 s a start). A known model's
        # max_tokens is within it, so it loads once; another is probed at PROBE_CTX first.
        n_ctx = min(max_tokens, MAX_CTX) if max_tokens else PROBE_CTX
        self._llm = self._load(path, n_ctx, threads, flash_attn)
        meta = self._llm.metadata  # the GGUF header's key-value pairs, as strings
        trained = int(meta.get(f"{meta.get('general.architecture')}.context_length") or n_ctx)
        if (want := min(trained, max_tokens or trained, MAX_CTX)) != n_ctx:
            self._llm.close()
            n_ctx = want
            self._llm = self._load(path, n_ctx, threads, flash_attn)
        self.name = name
        self.path = path
        self.identity = identity  # content hash of the weights: keys the embedding cache
        self.prefixes = prefixes  # (query, document) task prefixes, or None
        self.max_tokens = n_ctx
        self.dim = int(self._llm.n_embd())
        self.threads = threads
        self.bulk = bulk or bulk_threads()  # threads for calls of BULK_TEXTS texts or more
        self.beside_threads = max(1, threads // 2)  # the second context's, while the first is in use
        # the watch that lets a judgement take `bulk` threads on idle cores (first_threads)
        self.idle_cores = cores.watch() if idle_cores and self.bulk > threads else None
        self._beside_jobs = 0  # calls under way on the second context
        self._call_s: float | None = None  # seconds a first-context call (not bulk) takes, running mean
        self._jobs_lock = threading.Lock()
        self._lock = threading.Lock()
        self._first_used = 0.0  # time.monotonic() when a call on the first context last ended
        self._flash_attn = flash_attn
        self._beside: tuple[object, threading.Lock] | None = None  # the second context (`beside`), once loaded
        self._beside_loading = threading.Lock()
        self._local = threading.local()  # .beside: this thread's calls go to the second context

    @staticmethod
    def _load(path: str, n_ctx: int, threads: int, flash_attn: bool):
        from llama_cpp import Llama  # imported here: loading the library costs ~0.1 s

        try:
            # Non-causal embedding models need a whole sequence in one micro-batch, and
            # n_ubatch below n_batch has been seen to abort llama.cpp: keep them equal.
            # Flash attention: llama.cpp packs a batch's texts into one micro-batch, and its
            # plain attention spans every packed token (masked): a batch of 64 short texts
            # cost 1.5x their price one by one, with flash attention 0.75x (MiniLM, CPU time,
            # bench/embed_speed.py [--no-flash-attn]). Vectors agree to cosine 0.99999.
            load = lambda: Llama(model_path=path, embedding=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,  # noqa: E731
                                 n_threads_batch=threads, flash_attn=flash_attn, verbose=False)  # fmt: skip
            with progress.STDIO:  # it mutes stdout and stderr while it loads: no line of ours is lost meanwhile
                llm = load()
                if repack_crashes(llm.metadata):  # loaded again without them: only a quantised file, only on such a CPU
                    llm.close()
                    with _without_extra_buffers():
                        llm = load()
                return llm
        except Exception as e:
            raise EmbedError(f"cannot load model {path}: {e}") from None

    def prefixed(self, text: str, kind: Kind) -> str:
        if not self.prefixes:
            return text
        return (self.prefixes[0] if kind == "query" else self.prefixes[1]) + text

    @contextlib.contextmanager
    def beside(self):
        """Meanwhile, this thread's calls run on a second context of the same weights, on half
        the model's threads (one at least; loaded by the first call that needs it: the weights
        are mapped once, the context costs its buffers, 152 MB with nomic and 40 MB with
        MiniLM, and 0.1 s to load, which a warm start that finds every vector stored skips).
        A client's tools embedded there never wait for, nor hold up, the texts judged on the
        first: one text of 512 tokens is about 95 ms of MiniLM, which no slicing between
        batches can cut (issue 33)."""
        before = getattr(self._local, "beside", False)
        self._local.beside = True
        try:
            yield
        finally:
            self._local.beside = before

    def _second(self) -> tuple[object, threading.Lock]:
        if self._beside is not None:
            return self._beside
        with self._beside_loading:
            if self._beside is None:
                self._beside = (self._load(self.path, self.max_tokens, self.beside_threads, self._flash_attn), threading.Lock())
            return self._beside

    def _context(self) -> tuple[object, threading.Lock]:
        """The llama.cpp context this thread embeds on, and its lock."""
        return self._second() if getattr(self._local, "beside", False) else (self._llm, self._lock)

    def count_tokens(self, text: str) -> int:
        llm, lock = self._context()
        with lock:
            return len(llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))

    def _fit(self, text: str, llm) -> tuple[str, bool]:
        """Cut `text` to what the model takes, on a token boundary, and say whether we cut."""
        raw = text.encode("utf-8")
        if len(raw) < self.max_tokens:  # a token is at least one byte
            return text, False
        tokens = llm.tokenize(raw, add_bos=False, special=False)
        budget = self.max_tokens - 4  # room for BOS/CLS, SEP/EOS
        if len(tokens) <= budget:
            return text, False
        head = llm.detokenize(tokens[:budget]).decode("utf-8", errors="ignore")
        return head, True

    def embed(self, texts: list[str], kind: Kind = "query", bulk: bool = False) -> Embedded:
        """Unit vectors of `texts`. `bulk`: part of a large job, run on `self.bulk` threads.
        On the second context (`beside`) a job of several pieces (a catalog's tools, not one
        long turn a client waits for) goes piece by piece, each on every core while the first
        context is idle (a cold catalog beside no traffic indexes twice as fast) and on the
        second context's own threads when it is not."""
        if not texts:
            return Embedded(np.zeros((0, self.dim), np.float32), [])
        llm, lock = self._context()
        if llm is self._llm:
            with lock:
                threads, t0 = self.first_threads(bulk), time.perf_counter()
                try:
                    return self._embed_on(llm, texts, kind, threads, self.threads)
                finally:
                    self._first_used = time.monotonic()
                    if not bulk:  # on either thread count: a mean of one-thread calls alone stuck above the bar
                        took = time.perf_counter() - t0
                        self._call_s = took if self._call_s is None else 0.8 * self._call_s + 0.2 * took
        own, several = self.beside_threads, len(texts) > BESIDE_PIECE
        pieces = []
        with self._jobs_lock:
            self._beside_jobs += 1
        try:
            for lo in range(0, len(texts), BESIDE_PIECE):
                with lock:
                    threads = self.bulk if several and self._first_idle() else own
                    pieces.append(self._embed_on(llm, texts[lo : lo + BESIDE_PIECE], kind, threads, own))
        finally:
            with self._jobs_lock:
                self._beside_jobs -= 1
        return pieces[0] if len(pieces) == 1 else Embedded(np.vstack([p.vectors for p in pieces]), [cut for p in pieces for cut in p.truncated])

    def first_threads(self, bulk: bool = False) -> int:
        """Threads for a call on the first context: `bulk` for a bulk job, and for any call
        while the cores are idle (`idle_cores`: no other process is using them and nothing is
        being embedded on the second context) if this model's calls are long enough to gain
        (LONG_CALL_S); else `threads`."""
        if bulk:
            return self.bulk
        if (self.idle_cores is not None and self._call_s is not None and self._call_s >= LONG_CALL_S
                and self.idle_cores.spare and not self._beside_jobs):  # fmt: skip
            return self.bulk
        return self.threads

    def _first_idle(self) -> bool:
        return not self._lock.locked() and time.monotonic() - self._first_used >= IDLE_S

    def _embed_on(self, llm, texts: list[str], kind: Kind, threads: int, usual: int) -> Embedded:
        """Embed on one context (its lock held) with `threads`, back to its `usual` after."""
        fitted = [self._fit(self.prefixed(t, kind), llm) for t in texts]
        try:
            if threads != usual:
                llm._ctx.set_n_threads(threads, threads)
            raw = llm.embed([t for t, _ in fitted], normalize=False, truncate=False)
        except Exception as e:
            raise EmbedError(f"{self.name}: embedding failed: {e}") from None
        finally:
            if threads != usual:
                llm._ctx.set_n_threads(usual, usual)
        vectors = np.asarray(raw, dtype=np.float32).reshape(len(texts), self.dim)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors /= np.where(norms == 0, 1.0, norms)
        return Embedded(vectors, [cut for _, cut in fitted])
