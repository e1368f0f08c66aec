"""The TypeScript client (clients/typescript): its types are protocol.py's, and its own tests,
run by node's test runner, pass against a real `sidecar serve` on 127.0.0.1 (they start it,
with the small model). Without node on the machine that run is skipped, and says so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import typing

import msgspec
import pytest

from sidecar import protocol as p

from .conftest import ROOT

CLIENT = ROOT / "clients" / "typescript"
NODE_BOUND_S = 600  # two sidecar starts (one after a kill -9) and four tests: about 10 s here


def structs() -> list[type]:
    """Every struct a frame holds: the messages both ways and the parts they nest."""
    seen: list[type] = []
    todo = [*typing.get_args(p.ClientMessage), *typing.get_args(p.ServerMessage)]
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue
        seen.append(cls)
        for f in msgspec.inspect.type_info(cls).fields:
            todo += [t.cls for t in _nested(f.type)]
    return seen


def _nested(t: msgspec.inspect.Type) -> list[msgspec.inspect.StructType]:
    i = msgspec.inspect
    if isinstance(t, i.StructType):
        return [t]
    if isinstance(t, i.UnionType):
        return [s for u in t.types for s in _nested(u)]
    if isinstance(t, i.ListType):
        return _nested(t.item_type)
    return []


def interfaces(dts: str) -> dict[str, str]:
    """`export interface NAME { BODY }` of a .d.ts, by name."""
    return {m[1]: m[2] for m in re.finditer(r"export interface (\w+) \{\n(.*?)\n\}", dts, re.S)}


def test_the_generated_types_are_protocol_pys():
    run = subprocess.run([sys.executable, str(CLIENT / "gen_protocol.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_the_types_name_every_message_type_and_field_of_protocol_py():
    declared = interfaces((CLIENT / "src" / "protocol.d.ts").read_text())
    renamed = {"Error": "ErrorMessage"}
    every = structs()
    assert len(every) == 18, [c.__name__ for c in every]  # 7 + 7 messages, 4 parts
    for cls in every:
        name = renamed.get(cls.__name__, cls.__name__)
        assert name in declared, f"protocol.d.ts has no interface {name} for {cls.__name__}"
        props = dict(re.findall(r"^  (\w+)(\??): ", declared[name], re.M))
        info = msgspec.inspect.type_info(cls)
        wanted = [f.encode_name for f in info.fields] + ([info.tag_field] if info.tag else [])
        assert sorted(props) == sorted(wanted), f"{name}: {sorted(props)} != {sorted(wanted)}"
        if info.tag:
            assert f'  {info.tag_field}: "{info.tag}";' in declared[name]
        for f in info.fields:  # what the client sends may leave out what has a default
            if cls in typing.get_args(p.ClientMessage):
                assert (props[f.encode_name] == "?") == (not f.required), f"{name}.{f.encode_name}"
    protocol_js = (CLIENT / "src" / "protocol.js").read_text()
    assert f"export const VERSION = {p.VERSION};" in protocol_js


def test_the_client_has_a_method_for_every_message_a_client_sends():
    dts = (CLIENT / "src" / "index.d.ts").read_text()
    for tag in p.CLIENT_TYPES:
        if tag == "hello":  # said by connect() and reconnect()
            assert re.search(r"static connect\(", dts) and re.search(r"\breconnect\(\)", dts)
            continue
        method = re.sub(r"_(\w)", lambda m: m[1].upper(), tag)  # tool_result -> toolResult
        assert re.search(rf"^  {method}\(", dts, re.M), f"index.d.ts declares no {method}() for {tag!r}"


def node_flags(node: str) -> list[str]:
    """Node.js 22+ has a global WebSocket; 20 needs --experimental-websocket."""
    has = subprocess.run([node, "-e", "process.exit(typeof WebSocket === 'function' ? 0 : 1)"], timeout=60).returncode == 0
    return [] if has else ["--experimental-websocket"]


def test_node_test_passes_against_a_real_sidecar():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not found: the TypeScript client's tests (clients/typescript, node --test) did not run")
    env = {**os.environ, "SIDECAR_PYTHON": sys.executable}  # the sidecar of this venv
    run = subprocess.run([node, *node_flags(node), "--test"], cwd=CLIENT, env=env, capture_output=True, text=True, timeout=NODE_BOUND_S)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    passed = re.search(r"^# pass (\d+)$", out, re.M)
    assert passed and int(passed[1]) >= 4, out
    assert re.search(r"^# fail 0$", out, re.M), out
