"""Learning: what a catalog's cases, written cases and traffic teach the decision core.

`learned` holds the estimators (the ranker over a tool's views, the gate head, the query
adapter: each with `fit` / `predict`), `selffit` fits them on a catalog's own cases when that
beats the built-in calibration out of fold, and `traffic` turns resolved turns (a text, the
tool the model then called, or none) into a lesson the pipeline applies on top of its
calibration. Fitting is pure: it reads vectors and labels and returns numbers; serving decides
when to run it (`sidecar.serve.learner`).
"""
