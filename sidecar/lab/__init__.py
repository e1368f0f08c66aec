"""The lab: fitting and measuring (`tune`, `eval`, `cascade`, plots). It builds engines and
judges through them exactly as `serve` does; the runtime (engine, pipeline, gate, index,
recommender, store, servers) never imports it, so serving loads no fitting or measuring code
(tests/test_layout.py)."""
