"""`sidecar proxy`: OpenAI-compatible chat completions and Anthropic-compatible messages endpoints
in front of an upstream, which add the tools the engine injects to each request and run the
injected MCP tools themselves.

    shapes.py   the two APIs' request / chunk or event / reply shapes as dialects of one flow,
                SSE in and out (pure)
    offer.py    what a request gets: the engine's inject through session.py, the tier policy,
                the streaming gate over the reply (narration)
    app.py      the HTTP edge: ASGI app (uvicorn), upstream client (httpx2), tool rounds, /metrics

docs/proxy.md is the user's guide.
"""
