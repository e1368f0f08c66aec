"""Text to decision: the part every entry point shares.

A text (a user turn, or a clause of the model's reply cut by `stream`) is embedded (`embed`,
`models`), its views of each tool are computed (`index`: cosine over the tools' texts;
`lexical`: BM25; `cases`, `actions`, `arguments`), `pipeline` ranks the catalog and `gate`
turns the ranker's features and the patterns (`patterns`) into P(needs a tool) and a tier,
held to the thresholds of a `calibration`. Nothing here does I/O beyond loading a model and
reading or writing the store it is handed; nothing here knows of a socket.
"""
