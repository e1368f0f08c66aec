"""Serving: the websocket server and what it needs beside the engine.

`session` is the protocol's state machine, apart from I/O (a connection's frames in, events
out: hello, user turns, token streams cut into spans, results, feedback); `server` is the
I/O around it (websockets, the model thread, back-pressure, shedding) and `pending` the spans
waiting for the model; `records` writes what a session reports to the store; `learner` runs
learning from traffic beside serving; `web`, `page` and `examples` are the HTTP side (the
page, /healthz, /metrics via `telemetry`). The proxy (`sidecar.proxy`) and the MCP server
(`sidecar.mcp`) serve the same engine their own way.
"""
