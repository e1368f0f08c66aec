"""The recommender: which of the catalog's tools fit a query, ranked on relevance and history.

    intent.py       what the query asks for and what each tool does (pure)
    scoring.py      the multi-factor score and the intent adjustments (pure)
    filters.py      permissions, availability, rate limits, project tags (pure)
    recommender.py  retrieval, scoring, cache and fallbacks over a pipeline and a MetricsStore
    learn.py        A/B variants, offline evaluation and weight tuning from feedback

Names are imported lazily: `sidecar.config` imports `scoring`, and the recommender imports
the pipeline, which imports the config.
"""

from __future__ import annotations

_EXPORTS = {
    "Recommender": "recommender",
    "Recommendation": "recommender",
    "Recommendations": "recommender",
    "Factors": "recommender",
    "Fallback": "recommender",
    "Context": "filters",
    "Permissions": "filters",
    "Weights": "scoring",
    "Evaluation": "learn",
    "TuneResult": "learn",
    "assign_variant": "learn",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
