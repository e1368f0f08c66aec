"""A non-editable install works on its own: the wheel carries the patterns, the built-in
calibrations and the page as package data, and `detect` runs from it outside the source tree.
The distribution is `intent-sidecar` ("sidecar" on PyPI is an unrelated package); the import
package and the command stay `sidecar`."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import sidecar
from sidecar.core import models

from .conftest import CATALOGS, ROOT

BOUND_S = 600  # building the wheel fetches setuptools into an isolated build environment
DISTRIBUTION = "intent-sidecar"


def test_the_installed_distribution_is_intent_sidecar_and_provides_the_sidecar_package():
    assert importlib.metadata.version(DISTRIBUTION) == sidecar.__version__
    assert DISTRIBUTION in importlib.metadata.packages_distributions()["sidecar"]
    scripts = importlib.metadata.distribution(DISTRIBUTION).entry_points.select(group="console_scripts")
    assert [(e.name, e.value) for e in scripts] == [("sidecar", "sidecar.cli:main")]


def test_a_wheel_installed_into_a_fresh_venv_runs_detect_with_its_own_patterns(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
                   check=True, timeout=BOUND_S, capture_output=True)  # fmt: skip
    [wheel] = wheels.glob("intent_sidecar-*.whl")  # the wheel name normalises "-" to "_"
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("sidecar/builtin_patterns/negative.txt", "sidecar/builtin_patterns/high.txt", "sidecar/builtin_patterns/lists.txt",
                 "sidecar/core/calibrations/nomic-embed-text-v1.5.json", "sidecar/serve/page/index.html"):  # fmt: skip
        assert data in names, f"{data} missing from the wheel"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=BOUND_S)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site, str(wheel)],
                   check=True, timeout=BOUND_S, capture_output=True)  # fmt: skip
    # The dependencies (llama-cpp-python takes minutes to build) come from this environment as
    # a plain path entry: its .pth files, the editable install of the source tree among them,
    # are not processed there, so `sidecar` can only come from the wheel.
    (pathlib.Path(site) / "zz-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = subprocess.run([str(python), "-c", "import sidecar; print(sidecar.__file__)"], cwd=tmp_path,
                           check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    assert where.startswith(site), where
    out = subprocess.run(
        [str(python), "-m", "sidecar", "detect", "--json", "--model", models.SMALL_MODEL, "--catalog", str(CATALOGS / "notes.json"),
         "--store", str(tmp_path / "s.db"), "--source", "llm", "Let me search my notes for the kubernetes setup."],
        cwd=tmp_path, capture_output=True, text=True, timeout=BOUND_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    decision = json.loads(out.stdout)
    assert decision["path"].startswith("high:"), decision["path"]  # a built-in pattern matched: the wheel has them
    assert decision["fired"] and decision["inject"] and decision["inject"][0]["tool"] == decision["tool"]
    blocked = subprocess.run(
        [str(python), "-m", "sidecar", "detect", "--json", "--model", models.SMALL_MODEL, "--catalog", str(CATALOGS / "notes.json"),
         "--store", str(tmp_path / "s.db"), "the search algorithm in our notes app is slow"],
        cwd=tmp_path, capture_output=True, text=True, timeout=BOUND_S, check=True,
    )  # fmt: skip
    weighed = json.loads(blocked.stdout)  # the built-in head weighs the negative match: no fire
    assert weighed["path"].startswith("fallback:negative:") and not weighed["fired"], weighed
