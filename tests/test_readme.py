"""The README's first screen stays true: CI runs exactly its test command."""

from .conftest import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("python3 -m venv .venv") and "pytest" in ci
    first_screen = "\n".join(readme.splitlines()[:30])
    assert ci in first_screen
    assert "sidecar " in first_screen.split(ci)[0]  # the run command comes first
