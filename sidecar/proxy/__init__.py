"""`sidecar proxy`: an OpenAI-compatible chat completions endpoint in front of an upstream, which
adds the tools the engine injects to each request and runs the injected MCP tools itself.

    shapes.py   OpenAI request / chunk / reply shapes, SSE in and out (pure)
    offer.py    what a request gets: the engine's inject through session.py, the tier policy,
                the streaming gate over the reply (narration)
    app.py      the HTTP edge: ASGI app (uvicorn), upstream client (httpx2), tool rounds, /metrics

docs/proxy.md is the user's guide.
"""
