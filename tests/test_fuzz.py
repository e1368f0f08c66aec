"""Fuzzing a real `sidecar serve` (issue 13): Hypothesis-generated frames, seeded
(derandomize) and bounded (a fixed number of examples), over real websocket connections.

Every frame gets a typed `error` or its normal answer; no connection is closed (no 1011), the
log holds no traceback, and a second client keeps getting its injects throughout.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from sidecar import protocol as p

from .conftest import CATALOGS, serve_process

NOTES = CATALOGS / "notes.json"
SMALL = "all-minilm-l6-v2"
# Frames per run: SIDECAR_FUZZ_FRAMES (the 20,000-frame run: docs/benchmarks.md), in
# connections of FRAMES frames each; the default keeps the suite's run short.
FRAMES = 50
TOTAL = int(os.environ.get("SIDECAR_FUZZ_FRAMES", "5500"))
EXAMPLES = math.ceil(TOTAL / FRAMES)
WAIT_S = 60
SEARCH = "I should call semantic_search to find the kubernetes setup."

TYPES = [*p.CLIENT_TYPES, "frobnicate", "", "HELLO"]
FIELDS = ["type", "session", "stream", "text", "delta", "tool", "ok", "latency_ms", "error", "ref", "rating",
          "selected", "query", "tools", "version", "decisions", "agent", "permissions", "project"]  # fmt: skip
PLAUSIBLE = ["create_note", "semantic_search", "read_note", "s1", "s2", "r-1", "please create a note about it. "]

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=24)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)  # fmt: skip
values = json_values | st.sampled_from(PLAUSIBLE) | st.floats(0, 5000)
messages = st.builds(lambda kind, fields: {**fields, "type": kind} if kind is not None else fields,
                     st.sampled_from(TYPES) | st.none() | json_values,
                     st.dictionaries(st.sampled_from(FIELDS[1:]), values, max_size=6))  # fmt: skip


def _truncated(text: str, cut: int) -> str:
    return text[: cut % (len(text) + 1)]


def _spliced(data: bytes, at: int, junk: bytes) -> bytes:
    at %= len(data) + 1
    return data[:at] + junk + data[at:]


frames = st.one_of(
    messages.map(json.dumps),  # well-formed JSON, any shape
    st.builds(_truncated, messages.map(json.dumps), st.integers(0, 400)),  # cut anywhere
    st.builds(_spliced, messages.map(lambda m: json.dumps(m).encode()), st.integers(0, 400),
              st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b'"', b"\\u"])),  # fmt: skip
    st.binary(max_size=64),
    st.text(max_size=64),
    st.integers(1, 3000).map(lambda d: "[" * d + "]" * d),  # deep nesting
    st.integers(1, 3000).map(lambda d: '{"type":"hello","session":"x","tools":' + "[" * d + "]" * d + "}"),
    st.integers(0, 5000).map(lambda n: '{"type":"tool_result","tool":"create_note","ok":true,"latency_ms":1,"ref":' + "9" * max(n, 1) + "}"),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real `sidecar serve` process; its log in a file."""
    tmp = tmp_path_factory.mktemp("fuzz")
    with serve_process(["--model", SMALL, "--catalog", str(NOTES), "--store", str(tmp / "fuzz.db")], tmp) as server:
        yield server.url, server.log


def _exchange(ws, frame: str | bytes) -> list[p.ServerMessage]:
    """Send one frame, then a ping; everything that came back until the ping's pong (a frame
    that is a ping itself gets its own pong first)."""
    try:
        expected = p.decode_client(frame)
    except p.ProtocolError:
        expected = None
    ws.send(frame)
    ws.send('{"type":"ping"}')
    pongs = 2 if isinstance(expected, p.Ping) else 1
    got: list[p.ServerMessage] = []
    while pongs:
        msg = p.decode_server(ws.recv(WAIT_S))  # every message is a valid sidecar message
        got.append(msg)
        pongs -= isinstance(msg, p.Pong)
    return got


def _probe(probe, i: int) -> None:
    """The bystander: a request on a new stream, answered with its inject."""
    probe.send(json.dumps({"type": "user", "stream": f"p{i}", "text": SEARCH}))
    for _ in range(100):
        msg = p.decode_server(probe.recv(WAIT_S))
        if isinstance(msg, p.Inject):
            assert msg.stream == f"p{i}" and msg.tools[0].definition["name"] == "semantic_search"
            return
    raise AssertionError(f"no inject for p{i}")


def test_fuzzed_frames_get_typed_answers_and_never_break_a_connection(served):
    url, log = served
    counter = {"examples": 0, "frames": 0}
    with connect(url, open_timeout=WAIT_S) as probe:
        probe.send(json.dumps({"type": "hello", "session": "probe"}))
        assert isinstance(p.decode_server(probe.recv(WAIT_S)), p.Ready)

        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(st.booleans(), st.lists(frames, min_size=FRAMES, max_size=FRAMES))
        def fuzz(say_hello: bool, batch: list[str | bytes]) -> None:
            with connect(url, open_timeout=WAIT_S, max_size=None) as ws:
                if say_hello:
                    ws.send(json.dumps({"type": "hello", "session": f"fuzz-{counter['examples']}"}))
                    assert isinstance(p.decode_server(ws.recv(WAIT_S)), p.Ready)
                for frame in batch:
                    got = _exchange(ws, frame)
                    assert not [m for m in got if isinstance(m, p.Error) and m.code == "internal"], (frame, got)
                    try:
                        p.decode_client(frame)
                    except p.ProtocolError as e:  # a bad frame: its error, with the code it deserves
                        assert any(isinstance(m, p.Error) and m.code == e.code for m in got), (frame, e.code, got)
                    counter["frames"] += 1
                assert ws.close_code is None
            _probe(probe, counter["examples"])
            counter["examples"] += 1

        fuzz()
    assert counter["frames"] >= TOTAL
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
