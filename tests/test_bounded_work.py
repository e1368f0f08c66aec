"""Issue 33: the work one frame can cause is bounded. Each input below used to take seconds to
hours (quadratic backtracking or an unbounded list) on the event loop or the model thread; the
checks here are pure and bounded by generous walls (100x the linear cost), not speed targets."""

from __future__ import annotations

import fnmatch
import json
import time

import msgspec
import pytest

from sidecar.core import cases
from sidecar import protocol as p
from sidecar.recommend import filters
from sidecar.core.catalog import Tool


def _within(seconds: float, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    assert time.perf_counter() - t0 < seconds, f"{fn.__name__} took {time.perf_counter() - t0:.1f} s"
    return out


def test_the_nesting_check_is_linear_on_runs_of_escaped_quotes():
    """`"[" * 65 + '\\"' * N`: 16 s at 62 KB before; a 1 MiB frame would have taken an hour."""
    frame = "[" * 65 + '\\"' * 500_000
    assert _within(2.0, p.too_deep, frame)  # 65 open brackets: too deep, whatever follows
    assert not p.too_deep('{"a": "' + '\\"[' * 1000 + '"}')  # escaped quotes and brackets inside a string are text
    assert not p.too_deep('{"a": "x\\\\", "b": [[1]]}')  # an escaped backslash ends before the closing quote
    assert p.too_deep('{"a": "x\\\\"' + "[" * 70 + "]" * 70 + "}")  # so these brackets are outside the string
    assert p.too_deep('{"a": "x\\"' + "[" * 70 + "]" * 70 + '"}') is False  # and these are inside it


def test_a_frame_that_is_no_message_fails_at_its_first_bad_byte_unscanned():
    """The nesting attack, a megabyte of quotes after 65 brackets, fails in msgspec at byte 66
    (its error names the byte) instead of being scanned first: 6 ms of the event loop's a frame
    when the scan came first (bench/attacks.py, docs/benchmarks.md)."""
    for frame in ("[" * 65 + '"' * (1 << 20), "[" * 65 + '\\"' * (1 << 19)):
        with pytest.raises(p.ProtocolError) as e:
            p.decode_client(frame)
        assert e.value.code == "bad_json" and "(byte 6" in e.value.message and e.value.message != p.TOO_DEEP


@pytest.mark.parametrize("frame", [
    '{"type":"hello","session":"x","tools":' + "[" * 2142 + "]" * 2142 + "}",  # well-formed, deep in a field of the wrong type
    '{"type":"hello","session":"x","tools":' + "[" * 70 + "]" * 70 + "}",
    "[" * 3000 + "]" * 3000,  # well-formed, no object
    '{"type":"ping","x":' + "[" * 900 + "]" * 900 + "}",  # a valid message with a deep extra field
])  # fmt: skip
def test_a_deep_frame_gets_the_same_answer_whatever_the_callers_stack(frame):
    """msgspec gives up where the interpreter's recursion limit is near, which depends on the
    caller's stack (the fuzz test's process and the server's differ): every frame deeper than
    MAX_DEPTH is bad_json however deep the call."""

    def answer(stack: int) -> str:
        if stack:
            return answer(stack - 1)
        try:
            p.decode_client(frame)
        except p.ProtocolError as e:
            return e.code
        return "ok"

    assert {answer(n) for n in (0, 300, 600, 850)} == {"bad_json"}


def _depth(value) -> int:
    """The nesting of a decoded JSON value, as the protocol counts it (a scalar: 0)."""
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def test_the_nesting_check_agrees_with_the_decoded_depth_on_strings_full_of_quotes_and_brackets():
    """The check drops escapes and strings by replaces and one byte translate (issue 33: one
    regex match per quote cost 31 ms a 1 MB frame of quotes); on valid JSON, whatever its
    strings hold, it says what the decoded value's depth says."""
    import random

    rng = random.Random(33)
    texts = ['"', "[", "]", "{", "\\", '\\"', "x", "", "[[", '""', "é"]

    def value(depth: int):
        if depth == 0:
            return rng.choice([1, None, "".join(rng.choice(texts) for _ in range(rng.randint(0, 6)))])
        inner = [value(depth - 1)] + [rng.choice(texts) for _ in range(rng.randint(0, 2))]
        return inner if rng.random() < 0.7 else {rng.choice(texts): inner}

    for _ in range(400):
        v = value(rng.randint(p.MAX_DEPTH - 3, p.MAX_DEPTH + 2))
        frame = json.dumps(v, ensure_ascii=rng.random() < 0.5)
        assert p.too_deep(frame) == (_depth(v) > p.MAX_DEPTH), frame[:200]
    assert p.too_deep("[" * 65 + '"' * 999_900)  # the frame, bare quotes


def test_a_frame_of_many_tiny_values_is_refused_before_they_are_built():
    """msgspec builds a whole list before its max_length is checked, and a hello's tools are
    built whatever they hold: a megabyte of `[[[[[[]]]]]]` took 79 ms of the event loop, of
    `{}` 29 ms, of 75,000 globs 5 ms. A frame of more than MAX_VALUES commas and opening
    brackets outside its strings is refused first; inside strings they are text."""
    assert isinstance(p.decode_client(json.dumps({"type": "hello", "session": "s", "tools": ["t"] * 99}), max_values=102), p.Hello)  # 2 + 98 commas, a brace, a bracket
    with pytest.raises(p.ProtocolError, match="more than 101 JSON values"):  # the server's max_frame_values
        p.decode_client(json.dumps({"type": "hello", "session": "s", "tools": ["t"] * 99}), max_values=101)
    head = {"type": "hello", "session": "s"}  # 2 commas and a brace, then the list's bracket
    for name in ("t", "t\\", 'say "hi", [then] {go}'):  # a string that ends in an escaped backslash, one of escaped quotes
        at_cap = {**head, "tools": [name] * (p.MAX_VALUES - 3)}
        assert isinstance(p.decode_client(json.dumps(at_cap)), p.Hello)
        with pytest.raises(p.ProtocolError, match="too_many_values|JSON values"):
            p.decode_client(json.dumps({**head, "tools": [name] * (p.MAX_VALUES - 2)}))
    for frame in (json.dumps({**head, "tools": ["t"] * (p.MAX_VALUES - 2)}),
                  json.dumps({**head, "tools": [{"a": [[[[[[]]]]]]}] * (1 << 16)}),  # 839 KB, no comma in most of it
                  json.dumps({**head, "tools": [{}] * (1 << 18)}),
                  json.dumps({**head, "permissions": [f"*x{i}*z" for i in range(75_000)]}),
                  json.dumps({**head, "tools": [",[{"] * (1 << 16)})):  # fmt: skip
        with pytest.raises(p.ProtocolError) as e:
            _within(0.5, p.decode_client, frame)
        assert e.value.code == "too_many_values" and f"more than {p.MAX_VALUES} JSON values" in e.value.message
    for text in (",[{" * 100_000, '\\",[' * 50_000, "a, b, c\n" * 40_000):  # a pasted CSV, escaped quotes: all text
        msg = _within(0.5, p.decode_client, json.dumps({"type": "user", "stream": "s", "text": text}))
        assert isinstance(msg, p.User) and msg.text == text


def _values(v) -> int:
    """Commas and opening brackets outside strings of json.dumps(v): what MAX_VALUES bounds."""
    if isinstance(v, list):
        return 1 + max(len(v) - 1, 0) + sum(map(_values, v))
    if isinstance(v, dict):
        return 1 + max(len(v) - 1, 0) + sum(map(_values, v.values()))
    return 0


def test_values_counted_in_pieces_agree_with_the_decoded_value(monkeypatch):
    """A long frame's values are counted piece by piece, the quotes' parity carried across:
    with pieces of a few characters (cut anywhere but after a backslash), the count on frames
    of escaped quotes, backslashes and marks inside strings is still the decoded value's."""
    import random

    rng = random.Random(15)
    texts = ['"', "[", ",", "{", "\\", '\\"', "x", "", "\\\\", '""', "é", "\\n"]

    def value(depth: int):
        if depth == 0 or rng.random() < 0.2:
            return rng.choice([1, None, "".join(rng.choice(texts) for _ in range(rng.randint(0, 8)))])
        inner = [value(depth - 1) for _ in range(rng.randint(0, 4))]
        return inner if rng.random() < 0.6 else {rng.choice(texts) + str(i): x for i, x in enumerate(inner)}

    for size in (1, 2, 5, 64):
        monkeypatch.setattr(p, "PIECE_CHARS", size)
        for _ in range(150):
            v = value(rng.randint(1, 6))
            frame = json.dumps(v, ensure_ascii=rng.random() < 0.5)
            assert "".join(p._pieces(frame)) == frame
            assert all(not piece.endswith("\\") for piece in list(p._pieces(frame))[:-1])
            n = _values(v)
            for most in (max(n - 1, 0), n):
                assert p.too_many_values(frame, most) == (n > most and len(frame) > most), (size, most, frame[:200])


def test_a_long_frame_malformed_at_its_start_is_refused_unread(monkeypatch):
    """A long frame is first decoded in its first SKIM_CHARS: one malformed there (the nesting
    attack's, a megabyte of quotes after 65 brackets: 3-7 ms of the event loop before) is refused
    with msgspec's own error, its values never counted. A valid frame cut there in a number is
    decoded whole, as before."""
    counted = []
    monkeypatch.setattr(p, "_count_values", lambda frame, most, real=p._count_values: counted.append(len(frame)) or real(frame, most))
    for frame in ("[" * 65 + '"' * (1 << 20), "[" * 65 + '\\"' * (1 << 19), '{"type":"user",' + "x" * (1 << 20)):
        with pytest.raises(p.ProtocolError) as e:
            p.decode_client(frame)
        assert e.value.code == "bad_json" and "malformed JSON" in e.value.message
    assert not counted
    head = '{"type":"feedback","tool":"t","rating":'
    frame = head + " " * (p.SKIM_CHARS - len(head) - 2) + '1.5,"query":"' + "q" * (2 * p.MAX_VALUES) + '"}'
    with pytest.raises(msgspec.DecodeError, match="invalid number"):
        msgspec.json.decode(frame[: p.SKIM_CHARS])  # the cut falls in the number
    msg = p.decode_client(frame)
    assert isinstance(msg, p.Feedback) and msg.rating == 1.5 and len(msg.query) == 2 * p.MAX_VALUES and counted == [len(frame)]


def test_a_frame_of_many_values_is_counted_only_up_to_the_piece_that_passes_the_bound(monkeypatch):
    """Telling a piece's marks inside strings from those outside is the count's costly part:
    a megabyte of tiny values is refused after the first piece that passes MAX_VALUES (1 MB of
    `[[[[[[]]]]]]`: 4.8 ms of the event loop counted whole, 0.4 ms now), not after all of it."""
    told = []
    monkeypatch.setattr(p, "_marks", lambda frame, *every, real=p._marks: told.append(len(frame)) or real(frame, *every))
    for v in ('{"a":[[[[[[]]]]]]}', "{}", '"*x1*z"'):
        told.clear()
        frame = '{"type":"hello","session":"v","tools":[' + ",".join([v] * (1_000_000 // (len(v) + 1))) + "]}"
        with pytest.raises(p.ProtocolError, match="JSON values"):
            p.decode_client(frame)
        assert 0 < sum(told) <= 3 * p.PIECE_CHARS + 64 < len(frame) / 5  # the 16,384th value is in the first, second, third piece


def test_a_long_frame_of_few_marks_is_not_given_a_skeleton(monkeypatch):
    """A long frame whose brackets and commas, strings' included, are under both bounds cannot
    fail either check: it is decoded without its skeleton (a megabyte of tiny clauses: 3.1 ->
    1.3 ms of the event loop, of prose 2.1 -> 0.8 ms). One over either bound still gets it,
    and the answers are the same."""
    built = []
    monkeypatch.setattr(p, "_marks", lambda frame, *every, real=p._marks: built.append(len(frame)) or real(frame, *every))
    for text in ("abc\n" * 200_000, "Please look at the report, then tell me what changed. " * 16_000):  # 16,000 commas
        assert p.decode_client(json.dumps({"type": "user", "stream": "s", "text": text})).text == text
    assert not built
    deep = json.dumps({"type": "user", "stream": "s", "text": "[" * 65 + " " * p.MAX_VALUES})  # brackets in a string: text
    assert p.decode_client(deep).text.startswith("[" * 65) and len(built) == 1
    many = json.dumps({"type": "user", "stream": "s", "text": "a, " * p.MAX_VALUES})  # commas in a string: text
    assert p.decode_client(many).text == "a, " * p.MAX_VALUES and len(built) == 2


def test_hello_caps_the_permissions_list():
    """75,000 globs held the model thread 61.6 s; a hello now carries at most MAX_PERMISSIONS."""
    ok = {"type": "hello", "session": "s", "permissions": ["notes__*"] * p.MAX_PERMISSIONS}
    assert isinstance(p.decode_client(json.dumps(ok)), p.Hello)
    with pytest.raises(p.ProtocolError) as e:
        p.decode_client(json.dumps({**ok, "permissions": ["*x*z"] * (p.MAX_PERMISSIONS + 1)}))
    assert e.value.code == "invalid_field" and "permissions" in e.value.message
    with pytest.raises(p.ProtocolError):
        p.decode_client(json.dumps({**ok, "permissions": ["x" * (p.MAX_GLOB_CHARS + 1)]}))
    names = [f"server_{k:03}__" + "n" * 244 for k in range(p.MAX_PERMISSION_CHARS // 256)]  # 256 characters: a set, no compiling
    widest = ("a" * 15 + "*") * (p.MAX_GLOB_WILDCARDS - 1) + "a" * 15 + "?"  # 128 characters, 8 wildcards: a regex
    costliest = names[:-4] + [widest] * (p.MAX_PATTERN_CHARS // len(widest))
    assert isinstance(p.decode_client(json.dumps({**ok, "permissions": costliest})), p.Hello)
    for over in (names + ["x"], names[:-5] + [widest] * (p.MAX_PATTERN_CHARS // len(widest)) + ["*x"],
                 ["*a", "b?", "[ab]c"] * (p.MAX_PATTERN_WILDCARDS // 2) + ["*x"], [f"[ab]{k}" for k in range(p.MAX_PATTERNS + 1)]):  # fmt: skip
        with pytest.raises(p.ProtocolError) as e:  # their characters in all, the patterns' and their wildcards in all
            p.decode_client(json.dumps({**ok, "permissions": over}))
        assert e.value.code == "invalid_field" and "permissions" in e.value.message
    for wild in ("*", "?"):  # a wildcard more: a glob costs about 0.3 ms of compiling a wildcard
        with pytest.raises(p.ProtocolError) as e:
            p.decode_client(json.dumps({**ok, "permissions": ["notes__*", "a" + wild * (p.MAX_GLOB_WILDCARDS + 1)]}))
        assert e.value.code == "invalid_field" and "wildcards" in e.value.message


def test_a_sessions_globs_compile_once_as_one_regex_that_does_not_backtrack():
    """The patterns of the most characters and wildcards a hello may hold are compiled once
    and matched within a bound, the names beside them looked up; they match as fnmatch does."""
    part = p.MAX_PATTERN_CHARS // p.MAX_PATTERN_WILDCARDS  # 16 characters a wildcard, 8 wildcards a glob
    patterns = tuple(("*" + (f"{k}-" * part)[: part - 1]) * p.MAX_GLOB_WILDCARDS for k in range(p.MAX_PATTERN_WILDCARDS // p.MAX_GLOB_WILDCARDS))
    assert sum(map(len, patterns)) <= p.MAX_PATTERN_CHARS and sum(g.count("*") for g in patterns) <= p.MAX_PATTERN_WILDCARDS
    globs = patterns + tuple(f"server__tool_{k}" for k in range(p.MAX_PERMISSIONS - len(patterns)))
    compiled = _within(2.0, filters._globs, globs)
    assert filters._globs(globs) is compiled and len(compiled.names) == p.MAX_PERMISSIONS - len(patterns)
    name = "1-" * 80 + "x"  # holds all but a few of the second glob's parts: a backtracking matcher's worst
    assert not _within(0.5, compiled.match, name)
    assert compiled.match("server__tool_7") and compiled.match("y" + patterns[0].replace("*", "")) and not compiled.match("server__tool_")
    assert filters._globs(("git__*", "notes__read_note")).prefixes == ("git__",)
    samples = ["git__*", "*read*", "notes__?ead_note", "[!x]*__list_*", "exact_name", "[ab]__list_b", "*", "notes__*_note"]
    for tool in ["git__status", "notes__read_note", "filesystem__read_file", "exact_name", "a__list_b", "x__list_b"]:
        for glob in samples:
            assert filters._globs((glob,)).match(tool) == fnmatch.fnmatchcase(tool, glob), (tool, glob)
    assert not filters._globs(()).match("anything")  # an empty allow list allows nothing


@pytest.mark.parametrize("description", [
    "use to" + " " * 60_000 + "x",  # _USE_LIST: 16.1 s before
    "(" * 60_000,  # _clip's parenthetical: 5.1 s
    "[" * 60_000 + "x",  # _MARKUP's link
    "Reads a file." + " " * 60_000 + "/x",  # the sentence splitter's " / "
    "a\n" + " " * 60_000 + "b",
])  # fmt: skip
def test_deriving_cases_from_a_hostile_description_is_bounded(description):
    tool = msgspec.convert({"name": "t", "description": description, "inputSchema": {"type": "object"}}, Tool)
    phrases = _within(2.0, cases.derive, tool)
    assert all(len(x) <= 400 for x in phrases)


def test_derived_cases_of_ordinary_descriptions_are_unchanged():
    tool = msgspec.convert({"name": "read_text_file", "description": "Read the complete contents of a file (as text) from the file system. "
                            "Use this tool when you need to examine a file: handles UTF-8. See [the docs](https://x.y/(a)).",
                            "inputSchema": {"type": "object"}}, Tool)  # fmt: skip
    assert cases.derive(tool)[:2] == ["read text file", "read the complete contents of a file from the file system"]


def test_a_lone_surrogate_is_named_not_called_truncated():
    """Issue 33 item 7: "\\ud800" alone used to be reported as "Input data was truncated"."""
    with pytest.raises(p.ProtocolError) as e:
        p.decode_client('{"type":"user","stream":"a","text":"x\\ud800y"}')
    assert e.value.code == "bad_json" and "surrogate" in e.value.message and "truncated" not in e.value.message
    with pytest.raises(p.ProtocolError) as e:
        p.decode_client('{"type":"user","stream":"a","text":"abc')
    assert "truncated" in e.value.message  # a frame that really ends early still says so
    assert p.decode_client('{"type":"user","stream":"a","text":"\\ud83d\\ude00"}').text == "\U0001F600"
