"""The wire protocol: JSON text frames, one message each, tagged by "type".

Typed with msgspec and kept apart from any I/O (as the `websockets` library keeps its
protocol apart from its event loop), so the server, the client and the tests share one
definition, and a bad frame becomes an `Error` that names the problem instead of an
exception deep inside the server.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

VERSION = 2  # protocol version: sent in `ready`, checked against `hello.version`
# Versions a hello may ask for. 2 named the scores apart (docs/protocol.md, "Versions"): a
# session that said version 1 gets its frames with version 1's field names (`encode_for`).
VERSIONS = (1, 2)
MAX_REF_CHARS = 128  # a ref is a correlation id, stored with the call: not a payload
MAX_DEPTH = 64  # JSON nesting a frame may have (tool schemas are a few levels deep)
TOO_DEEP = f"malformed JSON: unbalanced, or nested deeper than {MAX_DEPTH} levels"
# Commas and opening brackets outside strings in one frame (`too_many_values`; the server's
# `max_frame_values`): about how many JSON values msgspec would build before any field's own
# limit is checked. A megabyte of tiny values (`[[[[[[]]]]]]`, `{}`, `"a"`) took 16-79 ms of
# the event loop to build; 16,384 take at most 1.3 ms. The 128 largest tools of the real
# catalogs hold 10,990.
MAX_VALUES = 16384
MAX_PERMISSIONS = 256  # globs in hello.permissions: each is matched against every tool a ranking considers
MAX_GLOB_CHARS = 256
MAX_PERMISSION_CHARS = 8192  # ... and their characters in all
MAX_GLOB_WILDCARDS = 8  # `*` and `?` in one glob ("github__*", "*__read_*" need one or two)
# The globs that hold a wildcard or a class (`*`, `?`, `[`) before their end are compiled into
# one regex at the session's hello, by `re`'s parser in Python, holding the GIL: about 30 us a
# glob, 2 us a character and 15 us a wildcard (8,192 characters with a star every four: 43 ms
# of a core, and the victim's pings 2-6x slower while it ran). Their number, their characters
# and their wildcards in all are capped, so a list compiles in at most 2.7 ms; the others are
# names, looked up in a set, and prefixes (`github__*`), one str.startswith (`needs_regex`).
MAX_PATTERNS = 64
MAX_PATTERN_CHARS = 1024
MAX_PATTERN_WILDCARDS = 64
# hello.resume: the key ready gave an earlier connection (secrets.token_hex(16): 32 characters)
Resume = Annotated[str, msgspec.Meta(min_length=16, max_length=64, pattern="^[A-Za-z0-9_-]+$")]

# A client's correlation id, echoed in `ack` and `error`: a short string or a 64-bit integer.
Ref = Annotated[str, msgspec.Meta(max_length=MAX_REF_CHARS)] | Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class ProtocolError(ValueError):
    """A frame that is not a valid client message; `code` is what `error.code` carries."""

    def __init__(self, code: str, message: str, ref: Ref | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.ref = ref


# Client -> sidecar ------------------------------------------------------------------


def wildcards(glob: str) -> int:
    """A permissions glob's wildcards (`*` and `?`), which the hello's caps count."""
    return glob.count("*") + glob.count("?")


def needs_regex(glob: str) -> bool:
    """Whether a permissions glob is matched by a regex: it holds a wildcard or a `[` class
    anywhere but a last `*` (a name is looked up in a set, a `prefix*` by str.startswith)."""
    body = glob[:-1] if glob.endswith("*") else glob
    return "*" in body or "?" in body or "[" in body


class Hello(msgspec.Struct, tag="hello", tag_field="type", kw_only=True, omit_defaults=True):
    """Opens a session. `tools` narrows or extends the server's catalog for this session:
    a string keeps that server tool, an object is an extra MCP tool definition."""

    session: str
    agent: str | None = None
    permissions: Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_GLOB_CHARS)]], msgspec.Meta(max_length=MAX_PERMISSIONS)] | None = None
    project: str | None = None
    tools: list[str | dict[str, Any]] | None = None
    version: int | None = None  # the client's protocol version
    decisions: bool = False  # opt in to a `decision` message for every judged span (debugging, benchmarks)
    resume: Resume | None = None  # an earlier connection's ready.resume: its refs carry over (a resend counts once)

    def __post_init__(self) -> None:
        if self.permissions and sum(map(len, self.permissions)) > MAX_PERMISSION_CHARS:
            raise ValueError(f"permissions hold more than {MAX_PERMISSION_CHARS} characters in all")
        if self.permissions and any(wildcards(g) > MAX_GLOB_WILDCARDS for g in self.permissions):
            raise ValueError(f"a permissions glob holds more than {MAX_GLOB_WILDCARDS} wildcards (* or ?)")
        patterns = [g for g in self.permissions or () if needs_regex(g)]
        if len(patterns) > MAX_PATTERNS:
            raise ValueError(f"more than {MAX_PATTERNS} permissions globs hold a wildcard or class (*, ? or [) before their end")
        if sum(map(len, patterns)) > MAX_PATTERN_CHARS:
            raise ValueError(f"the permissions globs with a wildcard or class (*, ? or [) before their end hold more than {MAX_PATTERN_CHARS} characters in all")
        if sum(map(wildcards, patterns)) > MAX_PATTERN_WILDCARDS:
            raise ValueError(f"the permissions globs hold more than {MAX_PATTERN_WILDCARDS} wildcards (* or ?) in all")


class User(msgspec.Struct, tag="user", tag_field="type"):
    """A whole user turn, judged whole with the user strategy."""

    stream: str
    text: str


class Token(msgspec.Struct, tag="token", tag_field="type"):
    """An increment of LLM output, any size down to one character."""

    stream: str
    delta: str


class End(msgspec.Struct, tag="end", tag_field="type"):
    stream: str


class ToolResult(msgspec.Struct, tag="tool_result", tag_field="type", kw_only=True, omit_defaults=True):
    tool: str
    ok: bool
    latency_ms: float
    error: str | None = None
    ref: Ref | None = None


class Feedback(msgspec.Struct, tag="feedback", tag_field="type", kw_only=True, omit_defaults=True):
    tool: str
    rating: float | None = None
    selected: bool | None = None
    query: str | None = None
    ref: Ref | None = None


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


ClientMessage = Hello | User | Token | End | ToolResult | Feedback | Ping
CLIENT_TYPES = {"hello": Hello, "user": User, "token": Token, "end": End, "tool_result": ToolResult, "feedback": Feedback, "ping": Ping}

# Sidecar -> client ------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", tag_field="type", kw_only=True):
    version: int  # the protocol version of this session: the hello's, else the current one
    model: str
    tools: list[str]  # the session's catalog, by name
    sidecar: str = ""  # the sidecar's package version
    # The key this connection's refs are kept under (a secret): a client that reconnects sends
    # it as hello.resume, and a tool_result or feedback it resends then counts once.
    resume: str = ""


class InjectedTool(msgspec.Struct):
    definition: dict[str, Any]  # the full MCP tool definition, as tools/list gives it
    relevance: float  # P(this is the tool the span asks for, among the catalog's): the tools come best first by the recommender's score
    why: str


class TriggerInfo(msgspec.Struct):
    """Where in the stream the decision came from; offsets count Unicode code points from
    the stream's first character."""

    text: str
    start: int
    end: int
    path: str  # "high:ID" or "fallback"


class WorkflowStep(msgspec.Struct):
    """One tool of an inject in the order a turn will likely need them: a tool learned to come
    before or after another injected one says so in `why`."""

    tool: str
    step: int  # 1, 2, ...
    why: str


class Inject(msgspec.Struct, tag="inject", tag_field="type", kw_only=True, omit_defaults=True):
    stream: str
    tier: Literal["auto", "confirm"]
    probability: float | None  # the gate's P(the span needs a tool); None: the model has no gate head
    tools: list[InjectedTool]
    trigger: TriggerInfo  # where in the stream the decision came from
    # When it was sent: the code points of the stream the sidecar had received by then (a user
    # turn: all of it). A short reply's only clause is judged at `end`: its trigger may be
    # [0:13] while the inject came at 58, the end of the stream.
    sent_at: int
    latency_ms: float  # from the frame that completed the span to this message
    # Only when a learned sequence added a tool: every injected tool in the order it is
    # likely called (prerequisites first). A client that ignores it loses nothing.
    workflow: list[WorkflowStep] = []
    # Only with `server.context_tools` set: tools this session was injected before that the
    # model's context should no longer hold (the budget is full; the oldest unused go first).
    drop: list[str] = []


class DecisionReport(msgspec.Struct, tag="decision", tag_field="type", kw_only=True):
    """Sent only to sessions that said `hello.decisions`: the gate's verdict on one judged
    span, fired or silent, so a client can see (and time) what did not inject."""

    stream: str
    source: Literal["user", "llm"]
    text: str  # the judged span
    start: int
    end: int
    reason: str  # why the span was cut: user, boundary, words, limit, end
    fired: bool
    tier: Literal["auto", "confirm"] | None
    path: str
    tool: str | None  # the best candidate, fired or not
    probability: float | None  # the gate's P(the span needs a tool); None: blocked by a pattern, or no gate head
    latency_ms: float  # from the frame that completed the span to this message


class FallbackSuggestion(msgspec.Struct):
    """A tool that could stand in for one that just failed (Recommender.fallbacks)."""

    tool: str
    score: float  # similarity x success rate x recency (x same-server boost)
    similarity: float
    success_rate: float | None  # None: too few calls to judge
    reason: str


class Ack(msgspec.Struct, tag="ack", tag_field="type", omit_defaults=True):
    """A tool_result or feedback is committed to the store; a failed tool_result's ack
    suggests stand-ins."""

    ref: Ref | None
    id: int  # the stored row's id (tool_calls for a tool_result, feedback for feedback)
    fallback_suggestions: list[FallbackSuggestion] | None = None


class Ended(msgspec.Struct, tag="ended", tag_field="type"):
    """Everything queued for a stream before its `end` has been judged and delivered."""

    stream: str


class Error(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    code: str
    message: str
    ref: Ref | None = None


class Pong(msgspec.Struct, tag="pong", tag_field="type"):
    pass


ServerMessage = Ready | Inject | DecisionReport | Ack | Ended | Error | Pong

# Codec --------------------------------------------------------------------------------

_client = msgspec.json.Decoder(ClientMessage)
_server = msgspec.json.Decoder(ServerMessage)
_encoder = msgspec.json.Encoder()


class _Envelope(msgspec.Struct):
    """Just enough of any frame to say what was wrong with it. `ref` stays raw JSON: a ref
    that is itself the problem (a 4,300-digit number) must not hide the frame's type."""

    type: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    ref: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


_envelope = msgspec.json.Decoder(_Envelope)
_ref = msgspec.json.Decoder(Ref)
_type = msgspec.json.Decoder(str)
_json = msgspec.json.Decoder(msgspec.Raw)  # any JSON, validated and not built: tells a truncated array from a valid non-object

# What decoding untrusted bytes can raise besides msgspec's own errors: invalid UTF-8 inside a
# JSON string (UnicodeDecodeError, a ValueError) and nesting deeper than the recursion limit.
_DECODE_FAILURES = (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError)


def encode(msg: ClientMessage | ServerMessage) -> bytes:
    return _encoder.encode(msg)


def encode_for(msg: ServerMessage, version: int | None) -> bytes:
    """A sidecar message as a client of protocol `version` reads it (None: the current one).
    Version 1 called a tool's relevance and the gate's probability both `score`: a version 1
    client gets that name back, and newer fields beside it (which a reader ignores), so it
    keeps working unchanged."""
    if version is None or version >= 2 or not isinstance(msg, (Inject, DecisionReport)):
        return _encoder.encode(msg)
    frame = msgspec.to_builtins(msg)
    if isinstance(msg, DecisionReport):
        frame["score"] = frame.pop("probability")
    else:
        for tool in frame["tools"]:
            tool["score"] = tool.pop("relevance")
    return _encoder.encode(frame)


def decode_client(frame: str | bytes, max_values: int = MAX_VALUES) -> ClientMessage:
    """A client frame as a typed message, or ProtocolError naming what is wrong. Never
    raises anything else: a frame is untrusted input, and an exception here would close
    the connection with 1011. `max_values`: see MAX_VALUES.

    A long frame's work is bounded before msgspec builds anything: one malformed in its
    first SKIM_CHARS is refused from them alone, and its values are counted piece by piece,
    refused at the first piece that takes them past `max_values`."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        try:
            frame = bytes(frame).decode("utf-8")  # a binary frame: the text-frame rule, checked here
        except UnicodeDecodeError as e:
            raise ProtocolError("bad_json", f"malformed JSON: not valid UTF-8 at byte {e.start}") from None
    skeleton, shallow = None, False
    if len(frame) > max_values:
        _refuse_a_bad_start(frame)
        skeleton = _count_values(frame, max_values)  # before msgspec builds them all (a list's max_length is checked once built)
        shallow = skeleton is None  # its brackets, strings' included, are too few to nest too deep
    try:
        msg = _client.decode(frame)
    except _DECODE_FAILURES as e:
        raise _explain(frame, e) from None
    if not shallow and too_deep(frame, skeleton):  # after decoding: a frame that is no message fails in msgspec first, most at their first bytes
        raise ProtocolError("bad_json", TOO_DEEP)
    return msg


# A long frame's first characters, checked as JSON before anything reads the rest: a frame
# malformed there (the nesting attack's `"[" * 65` and a megabyte of quotes; most attacks) is
# refused at once, whatever follows.
SKIM_CHARS = 4096
# Pieces the values of a long frame are counted in, each cut after a character that is not a
# backslash (no escape spans two): a frame of many values is refused at the first piece that
# takes it past the bound, not after a scan of all of it.
PIECE_CHARS = 1 << 16
_NOT_BACKSLASH = re.compile(r"[^\\]")


def _refuse_a_bad_start(frame: str) -> None:
    """ProtocolError for a frame whose first SKIM_CHARS are no valid start of JSON. Cut there,
    a frame's JSON is only missing its end (msgspec says "truncated"), unless the cut falls
    in a number or a literal: any other complaint is checked on the whole frame, which fails
    at the same byte when it is malformed there."""
    try:
        _json.decode(frame[:SKIM_CHARS])
    except (msgspec.DecodeError, ValueError) as e:
        if "truncated" in str(e):
            return
        try:
            _json.decode(frame)
        except (msgspec.DecodeError, ValueError) as err:
            raise _explain(frame, err) from None
        except RecursionError:
            return
    except RecursionError:
        return  # deep from its first bytes: the checks that follow tell


def _pieces(frame: str) -> Iterator[str]:
    """`frame` in pieces of about PIECE_CHARS characters, each ending in a character that is
    not a backslash, so that no escape spans two pieces (a run of backslashes stays whole)."""
    start, size = 0, PIECE_CHARS
    while len(frame) - start > size:
        after = _NOT_BACKSLASH.search(frame, start + size - 1)
        if after is None:
            break
        yield frame[start : after.end()]
        start = after.end()
    yield frame[start:]


def _count_values(frame: str, most: int) -> bytes | None:
    """ProtocolError `too_many_values` when the frame holds more than `most` commas and opening
    brackets outside its strings. Else its skeleton (`_marks`) for the nesting check, or None
    when even its marks inside strings are under both bounds: then neither check can fail (a
    long prose turn is counted in 0.4 ms a megabyte and given no skeleton). Piece by piece:
    the marks of each, strings' included, counted first; once they pass `most`, which lie
    inside strings is told by the parity of the quotes before each (a running count carried
    from piece to piece), and the count stops at the piece that passes `most`."""
    held: list[tuple[str, bytes]] = []  # pieces whose values are not yet told apart
    skeleton: list[bytes] = []
    upper = opening = outside = inside = 0  # inside: quotes so far, modulo 2
    for piece in _pieces(frame):
        every = piece.encode("utf-8", "surrogatepass").translate(None, _NOT_MARK)
        opens = every.count(b"[") + every.count(b"{")
        upper += opens + every.count(b",")
        opening += opens
        held.append((piece, every))
        if upper <= most:
            continue
        for text, marks in held:
            skeleton.append(_marks(text, marks))
            codes = np.frombuffer(skeleton[-1], np.uint8)
            quotes = codes == ord('"')
            counted = (codes == ord(",")) | (codes == ord("[")) | (codes == ord("{"))
            parity = (np.cumsum(quotes, dtype=np.uint8) + inside) & 1  # wraps at 256: parity survives
            outside += int(np.count_nonzero(counted & (parity == 0)))
            inside = (inside + int(np.count_nonzero(quotes))) & 1
            if outside > most:
                raise ProtocolError("too_many_values", f"the frame holds more than {most} JSON values (commas and brackets outside strings)")
        held.clear()
    if upper <= most and opening <= MAX_DEPTH:
        return None
    return b"".join(skeleton + [_marks(text, marks) for text, marks in held])


# Regexes and tables of too_deep: no pattern there backtracks, and the one that matches runs
# once per string left after the others (a string pattern that took escapes in backtracked on
# a run of `\"`: a 62 KB frame held the event loop for 16 s; one match per quote, 31 ms a
# 1 MB frame of quotes: issue 33).
_STRING = re.compile(rb'"[^"]*"')
_NOT_MARK = bytes(b for b in range(256) if b not in b'[]{}",')
_LONE_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_SQUARE = bytes.maketrans(b"{}", b"[]")


def too_deep(frame: str, marks: bytes | None = None) -> bool:
    """Whether a JSON text nests deeper than MAX_DEPTH, or its brackets (outside strings) do
    not balance. A fixed limit: msgspec fails by itself only near the interpreter's recursion
    limit, which depends on the caller's stack (then the same error is given). Checked after a
    frame decoded as a message, so the frames that are none fail at their first bytes in
    msgspec instead. Linear, in C-speed string operations with few matches: escapes go by two
    replaces (pairs of backslashes, then escaped quotes), everything but brackets and quotes by
    one bytes.translate, adjacent quotes in pairs (which keeps every other character inside or
    outside its string), and only then the strings left, each holding a bracket; then each
    round drops the innermost bracket pairs. `marks`: the frame's `_marks`, if already made."""
    if frame.count("[") + frame.count("{") <= MAX_DEPTH:  # the common case
        return False
    skeleton = (_marks(frame) if marks is None else marks).translate(None, b",").replace(b'""', b"")
    brackets = _STRING.sub(b"", skeleton).translate(_SQUARE, b'"')  # an unpaired quote: dropped (the frame is bad JSON anyway)
    if b"[" * (MAX_DEPTH + 1) in brackets:
        return True
    for _ in range(MAX_DEPTH):
        inner = brackets.replace(b"[]", b"")
        if not inner:
            return False
        if inner == brackets:  # no pair left to drop: unbalanced
            return True
        brackets = inner
    return True


def too_many_values(frame: str, most: int = MAX_VALUES) -> bool:
    """Whether a frame holds more than `most` commas and opening brackets outside its strings
    (`_count_values`; a frame of no more characters cannot)."""
    if len(frame) <= most:
        return False
    try:
        _count_values(frame, most)
    except ProtocolError:
        return True
    return False


def _marks(frame: str, every: bytes | None = None) -> bytes:
    """What both checks read of a frame: its brackets, commas and quotes, with escaped
    backslashes and escaped quotes dropped first. `every`: the frame's marks with nothing
    dropped, if already made: they are the answer when no quote is escaped."""
    if '\\"' in frame:  # a backslash before a quote: some may escape it
        frame = frame.replace("\\\\", "").replace('\\"', "")
    elif every is not None:
        return every
    return frame.encode("utf-8", "surrogatepass").translate(None, _NOT_MARK)


def decode_server(frame: str | bytes) -> ServerMessage:
    """For clients: a sidecar frame as a typed message."""
    try:
        return _server.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError("bad_message", f"not a sidecar message: {e}") from None


def _explain(frame: str, err: Exception) -> ProtocolError:
    """Turn msgspec's error into one of: bad_json, bad_message, unknown_type, missing_field,
    invalid_field. Only failed frames pay for this second look. msgspec recurses: where it
    gives up depends on the caller's stack, so a well-formed frame is scanned for depth
    (`too_deep`) and anything deeper than MAX_DEPTH is bad_json whichever way it failed; a
    malformed frame, most attacks among them, fails at its first bad byte, unscanned."""
    if isinstance(err, RecursionError):
        return ProtocolError("bad_json", TOO_DEEP)
    try:
        env = _envelope.decode(frame)
    except msgspec.ValidationError:  # (a subclass of DecodeError) well-formed so far, not an object
        return _not_an_object(frame)
    except RecursionError:
        return ProtocolError("bad_json", TOO_DEEP)
    except (msgspec.DecodeError, ValueError) as e:
        text = frame if isinstance(frame, str) else bytes(frame).decode("utf-8", "replace")
        if "truncated" in str(e) and _LONE_SURROGATE.search(text):  # msgspec says "truncated" of a lone surrogate escape
            return ProtocolError("bad_json", "malformed JSON: a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair) is no character")
        return ProtocolError("bad_json", f"malformed JSON: {e}")
    if too_deep(frame):  # well-formed, so scanned: deep or not, the same answer whatever the caller's stack
        return ProtocolError("bad_json", TOO_DEEP)
    ref = _ref_of(env.ref)
    if not env.type:
        return ProtocolError("missing_field", 'message has no "type" field', ref)
    kind = _type_of(env.type)
    if kind not in CLIENT_TYPES:
        known = ", ".join(CLIENT_TYPES)
        shown = repr(kind) if kind is not None else bytes(env.type).decode("utf-8", "replace")
        return ProtocolError("unknown_type", f"unknown message type {_short(shown, quote=False)} (known: {known})", ref)
    text = str(err)
    if text.startswith("Object missing required field"):
        field = text.split("`")[1] if "`" in text else "?"
        return ProtocolError("missing_field", f"{kind}: missing required field {field!r}", ref)
    return ProtocolError("invalid_field", f"{kind}: {_short(text.replace('$.', ''), quote=False)}", ref)


def _not_an_object(frame: str) -> ProtocolError:
    """A frame that did not start with an object: bad_json when it is not JSON either
    (`[1,2`: the envelope gave up at the first token, before the truncation)."""
    try:
        _json.decode(frame)
    except RecursionError:
        return ProtocolError("bad_json", TOO_DEEP)
    except (msgspec.DecodeError, ValueError) as e:
        return ProtocolError("bad_json", f"malformed JSON: {_short(str(e), quote=False)}")
    if too_deep(frame):
        return ProtocolError("bad_json", TOO_DEEP)
    return ProtocolError("bad_message", 'a message is a JSON object with a "type" field')


def _type_of(raw: msgspec.Raw) -> str | None:
    """The frame's "type" when it is a string."""
    try:
        return _type.decode(raw)
    except _DECODE_FAILURES:
        return None


def _ref_of(raw: msgspec.Raw) -> Ref | None:
    """The frame's `ref` if it is a valid one (to echo in the error), else None."""
    if not raw:
        return None
    try:
        return _ref.decode(raw)
    except _DECODE_FAILURES:
        return None


MAX_ECHO_CHARS = 200  # of a client's value quoted back in an error message


def _short(value: Any, quote: bool = True) -> str:
    """A client's value for an error message, cut: an error must not echo a megabyte back."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "..."
