"""Intent-detection sidecar: text in, tiered gate, recommender, tool injections out."""

__version__ = "0.1.0"
