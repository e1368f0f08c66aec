"""Quantised variants (issue 12, part 1): `pull` writes them with llama.cpp's quantizer beside
the f16 file, records and checks their sha256, `model list` shows them, they load and embed
like the f16 model, take its calibration, and never share its cached vectors. MiniLM, whose
quantisation takes about a second; the f16 file is the provisioned one, linked into a tmp dir."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from sidecar.core import calibration as calib
from sidecar import config as config_mod
from sidecar.core import models, pipeline
from sidecar.core.embed import Embedder
from sidecar.store import open_store
from tests.conftest import CATALOGS, ROOT
from tests.test_models import link_or_copy

MINILM = models.SMALL_MODEL
Q8 = f"{MINILM}:q8_0"
TEXTS = ["how do I reset my password", "search my notes for the kubernetes setup", "banana bread recipe",
         "open a pull request for my branch", "what time is it in Tokyo right now"]  # fmt: skip


@pytest.fixture(scope="module")
def f16_file() -> Path:
    """The provisioned MiniLM f16 file (fetched into the default model dir if missing)."""
    return Path(models.resolve(f"{MINILM}:f16", progress=False).path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, f16_file) -> Path:
    """`sidecar model pull all-minilm-l6-v2` into a dir holding the f16 file: the CLI's pull
    verifies it and writes the PULLED_QUANTS variants beside it."""
    d = tmp_path_factory.mktemp("models")
    link_or_copy(f16_file, d / f16_file.name)
    run = subprocess.run([sys.executable, "-m", "sidecar", "model", "pull", MINILM, "--dir", str(d)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    written = [f"{MINILM}:{q}: {d / f'all-minilm-l6-v2.{q}.gguf'}" for q in models.pulled_quants()]
    assert run.stdout.splitlines() == [f"{MINILM}: {d / f16_file.name}", *written]
    assert (f"{MINILM}:bf16: {d / 'all-minilm-l6-v2.bf16.gguf'}" in written) == models.native_bf16()
    assert "llama" not in run.stderr and "tensor" not in run.stderr  # the quantizer's report is kept off stderr
    return d


def test_pull_writes_a_q8_0_file_with_its_sha256_recorded(model_dir, f16_file):
    spec = models.KNOWN_MODELS[MINILM]
    path = model_dir / models.variant_filename(spec, "q8_0")
    assert path.name == "all-minilm-l6-v2.q8_0.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    assert path.stat().st_size < 0.7 * f16_file.stat().st_size  # 8.5 bits a weight, not 16
    record = msgspec.json.decode(models.record_path(path).read_bytes(), type=models.QuantRecord)
    assert record.model == Q8 and record.quant == "q8_0"
    assert record.sha256 == models.file_sha256(path)
    assert record.source_sha256 == models.file_sha256(f16_file)
    assert record.quantizer.startswith("llama-cpp-python")
    models.verify(Q8, path)  # raises if it does not verify
    resolved = models.resolve(Q8, dest=model_dir, auto_pull=False)
    assert resolved.name == Q8 and resolved.path == str(path) and resolved.spec.sha256 == record.sha256


def test_a_tampered_variant_fails_verification_and_pull_quantises_it_again(model_dir, tmp_path):
    for p in model_dir.iterdir():
        if p.suffix in (".gguf", ".json") and not p.name.startswith("."):
            shutil.copyfile(p, tmp_path / p.name)
    path = tmp_path / "all-minilm-l6-v2.q8_0.gguf"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(models.ProvisioningError, match="checksum mismatch for all-minilm-l6-v2:q8_0"):
        models.verify(Q8, path)
    with pytest.raises(models.ProvisioningError, match=r"pull all-minilm-l6-v2:q8_0 --force"):
        models.resolve(Q8, dest=tmp_path, auto_pull=False)
    assert models.pull(Q8, dest=tmp_path, progress=False) == path
    models.verify(Q8, path)
    assert path.read_bytes() == (model_dir / path.name).read_bytes()  # the quantizer is deterministic
    assert models.pull(MINILM, dest=tmp_path, progress=False) == tmp_path / "all-minilm-l6-v2.f16.gguf"  # no variant asked for
    models.record_path(path).unlink()
    with pytest.raises(models.ProvisioningError, match="has no record of its sha256"):
        models.verify(Q8, path)


def test_the_variant_loads_and_embeds_close_to_f16(model_dir):
    spec = models.KNOWN_MODELS[MINILM]
    f16 = Embedder(str(model_dir / spec.filename), name=MINILM, identity="f16", threads=1, max_tokens=spec.n_ctx)
    q8 = Embedder(str(model_dir / models.variant_filename(spec, "q8_0")), name=Q8, identity="q8", threads=1, max_tokens=spec.n_ctx)
    a, b = f16.embed(TEXTS).vectors, q8.embed(TEXTS).vectors
    assert b.shape == a.shape == (len(TEXTS), spec.dim)
    cos = np.sum(a * b, axis=1)
    assert cos.min() > 0.99, cos
    assert not np.array_equal(a, b)  # it is another model file, not the same one twice
    # The order the f16 model gives is kept: a paraphrase above an unrelated text.
    v = q8.embed(["how do I reset my password", "password reset instructions", "banana bread recipe"]).vectors
    assert v[0] @ v[1] > v[0] @ v[2] + 0.1


def test_a_plain_name_loads_the_bf16_file_where_the_cpu_computes_bf16(model_dir, tmp_path, f16_file):
    """Where llama.cpp has native bf16 dot products, a plain name is the bf16 variant (pull
    wrote it): vectors as f16's to 1e-4, the embedding cache apart. Elsewhere it is the f16 file.
    Without pulling, a dir that never got the variant still loads its f16 file."""
    resolved = models.resolve(MINILM, dest=model_dir, auto_pull=False)
    if not models.native_bf16():
        assert resolved.name == MINILM and resolved.path == str(model_dir / f16_file.name)
        return
    bf16 = model_dir / "all-minilm-l6-v2.bf16.gguf"
    assert resolved.name == MINILM and resolved.spec.name == f"{MINILM}:bf16" and resolved.path == str(bf16)
    assert resolved.spec.sha256 == models.file_sha256(bf16) != models.file_sha256(f16_file)
    assert calib.in_force(resolved.name, None) == calib.in_force(MINILM, None)  # the base model's calibration
    spec = models.KNOWN_MODELS[MINILM]
    f16 = Embedder(str(f16_file), name=MINILM, identity="f16", threads=1, max_tokens=spec.n_ctx)
    bf = Embedder(resolved.path, name=resolved.name, identity="bf16", threads=1, max_tokens=spec.n_ctx)
    a, b = f16.embed(TEXTS).vectors, bf.embed(TEXTS).vectors
    assert np.sum(a * b, axis=1).min() > 0.9999 and not np.array_equal(a, b)
    assert models.resolve(f"{MINILM}:f16", dest=model_dir, auto_pull=False).path == str(model_dir / f16_file.name)
    link_or_copy(f16_file, tmp_path / f16_file.name)
    assert models.resolve(MINILM, dest=tmp_path, auto_pull=False).path == str(tmp_path / f16_file.name)


def test_a_variant_quantised_on_demand_by_name(model_dir):
    path = models.pull(f"{MINILM}:q4_k_m", dest=model_dir, progress=False)
    assert path.name == "all-minilm-l6-v2.q4_k_m.gguf"
    models.verify(f"{MINILM}:q4_k_m", path)
    assert path.stat().st_size < (model_dir / "all-minilm-l6-v2.q8_0.gguf").stat().st_size


def test_resolving_a_missing_variant_without_pulling_says_how_to_get_it(tmp_path, f16_file):
    link_or_copy(f16_file, tmp_path / f16_file.name)
    with pytest.raises(models.ProvisioningError, match=r"run `sidecar model pull all-minilm-l6-v2:q8_0`"):
        models.resolve(Q8, dest=tmp_path, auto_pull=False)


def test_model_list_shows_the_variants(model_dir):
    run = subprocess.run([sys.executable, "-m", "sidecar", "model", "list", "--json", "--dir", str(model_dir)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = {r["name"]: r for r in json.loads(run.stdout)["models"]}
    assert set(rows) == set(models.KNOWN_MODELS)
    variants = {v["name"]: v for v in rows[MINILM]["variants"]}
    assert set(variants) == {f"{MINILM}:{q}" for q in models.QUANTS}
    q8 = variants[Q8]
    assert q8["installed"] is True and q8["quant"] == "q8_0"
    assert q8["path"] == str(model_dir / "all-minilm-l6-v2.q8_0.gguf") and q8["size"] == Path(q8["path"]).stat().st_size
    assert all(not v["installed"] for v in rows[models.DEFAULT_MODEL]["variants"])
    text = subprocess.run([sys.executable, "-m", "sidecar", "model", "list", "--dir", str(model_dir)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert text.returncode == 0
    line = next(ln for ln in text.stdout.splitlines() if Q8 in ln)
    assert "MB" in line and "not pulled" not in line
    assert f"not pulled (sidecar model pull {models.DEFAULT_MODEL}:q8_0)" in text.stdout


def test_a_bad_variant_in_the_config_is_a_clear_error(tmp_path):
    toml = tmp_path / "sidecar.toml"
    toml.write_text(f'[model]\nname = "{MINILM}:q3_k"\n')
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.load(toml, env={})
    msg = str(e.value)
    assert str(toml) in msg and "unknown variant 'q3_k' of all-minilm-l6-v2" in msg and "q8_0" in msg
    assert "\n" not in msg
    assert config_mod.load(env={}, overrides={("model", "name"): Q8}).model.name == Q8
    assert config_mod.load(env={"SIDECAR_MODEL": "/some/file:q3.gguf"}).model.name == "/some/file:q3.gguf"  # a path is no variant
    run = subprocess.run([sys.executable, "-m", "sidecar", "detect", "--config", str(toml), "--catalog", str(CATALOGS / "notes.json"), "hi"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert "unknown variant 'q3_k'" in run.stderr


def test_a_variant_takes_its_base_models_calibration():
    cal, origin = calib.in_force(Q8, None)
    assert origin == "builtin" and cal is calib.builtin(MINILM)
    assert calib.in_force(Q8, cal) == (cal, "calibration")  # a file fitted on the base applies
    other = msgspec.structs.replace(cal, model=models.DEFAULT_MODEL)
    with pytest.raises(calib.CalibrationError, match="fitted on 'nomic-embed-text-v1.5'"):
        calib.in_force(Q8, other)
    fitted_on_variant = msgspec.structs.replace(cal, model=Q8)
    with pytest.raises(calib.CalibrationError):
        calib.in_force(MINILM, fitted_on_variant)  # the variant's own fit is not the f16 model's
    assert calib.builtin(f"{MINILM}:bf16") is calib.builtin(Q8) is calib.builtin(MINILM)  # what tune starts from
    on_bf16 = msgspec.structs.replace(cal, model=f"{MINILM}:bf16")  # a tune where the plain name loads bf16
    assert calib.in_force(MINILM, on_bf16) == (on_bf16, "calibration")
    assert calib.in_force(f"{MINILM}:f16", on_bf16) == (on_bf16, "calibration")
    with pytest.raises(calib.CalibrationError):
        calib.in_force(Q8, on_bf16)  # bf16 and f16 are the same weights; Q8_0 is not


def test_variants_never_share_cached_vectors(model_dir, tmp_path):
    store = open_store(tmp_path / "s.db")
    pipes = {}
    for name in (MINILM, Q8):
        cfg = config_mod.load(env={}, overrides={("model", "name"): name, ("model", "dir"): str(model_dir),
                                                 ("catalogs",): [str(CATALOGS / "notes.json")]})  # fmt: skip
        pipes[name] = pipeline.from_config(cfg, store=store, progress=False)
    f16, q8 = pipes[MINILM].embedder, pipes[Q8].embedder
    assert q8.name == Q8 and q8.identity == models.resolve(Q8, dest=model_dir, auto_pull=False).spec.sha256
    assert f16.identity != q8.identity
    # The second model found nothing of the first's in the cache: it embedded every text itself.
    stats = {n: p.index_for("user").stats for n, p in pipes.items()}
    assert stats[Q8].embedded == stats[MINILM].embedded > 0 and stats[Q8].cached == 0
    rows = dict(store.query("SELECT model, count(*) FROM embedding_cache GROUP BY model"))
    assert rows[f16.identity] == rows[q8.identity] == stats[MINILM].embedded
    assert pipes[Q8].thresholds_origin == "builtin"
    d = pipes[Q8].detect("let me search my notes for the kubernetes setup")
    assert d.fired and d.tool == pipes[MINILM].detect("let me search my notes for the kubernetes setup").tool


def test_a_store_keeps_a_variants_hash_and_a_changed_file_is_still_refused(model_dir, tmp_path):
    """A start checks the variant it loads against its recorded sha256 through the store's
    digest (kept per path, size and mtime: hashing nomic's 274 MB file was 0.26 s of every
    start). The kept hash is the file's; once the file's bytes change, it is hashed again and
    refused."""
    d = tmp_path / "models"
    d.mkdir()
    src = model_dir / "all-minilm-l6-v2.q8_0.gguf"
    shutil.copyfile(src, d / src.name)
    shutil.copyfile(models.record_path(src), models.record_path(d / src.name))
    store = open_store(str(tmp_path / "s.db"))
    resolved = models.resolve(Q8, dest=d, auto_pull=False, digest=store.file_sha256)
    recorded = msgspec.json.decode(models.record_path(src).read_bytes(), type=models.QuantRecord).sha256
    assert resolved.spec.sha256 == recorded == models.file_sha256(d / src.name)
    assert store.query("SELECT sha256 FROM file_digest WHERE path=?", (str((d / src.name).resolve()),)) == [(recorded,)]
    assert models.resolve(Q8, dest=d, auto_pull=False, digest=store.file_sha256).spec.sha256 == recorded  # from the store

    with open(d / src.name, "r+b") as f:  # same size, other bytes (and a newer mtime)
        f.seek(src.stat().st_size // 2)
        f.write(b"\xff" * 64)
    with pytest.raises(models.ProvisioningError, match="checksum"):
        models.resolve(Q8, dest=d, auto_pull=False, digest=store.file_sha256)


def test_a_quantised_file_loads_without_repacked_buffers_where_they_crash(model_dir):
    """On a CPU with AMX int8, llama.cpp's repacked buffer types segfault in encode on a
    quantised model (the test above died there on a Xeon); only there, and only for a
    quantised file, the sidecar loads it again without them. Whether llama.cpp uses AMX int8
    is given, so both answers are checked on any machine, on the files' own metadata as
    llama.cpp read it; the q8 model embeds on this machine whichever it is."""
    from sidecar.core.embed import repack_crashes, system_info

    spec = models.KNOWN_MODELS[MINILM]
    f16 = Embedder(str(model_dir / spec.filename), name=MINILM, identity="f16", threads=1, max_tokens=spec.n_ctx)
    q8 = Embedder(str(model_dir / models.variant_filename(spec, "q8_0")), name=Q8, identity="q8", threads=1, max_tokens=spec.n_ctx)
    assert repack_crashes(q8._llm.metadata, amx_int8=True) and not repack_crashes(q8._llm.metadata, amx_int8=False)
    assert not repack_crashes(f16._llm.metadata, amx_int8=True) and not repack_crashes(f16._llm.metadata, amx_int8=False)
    assert not repack_crashes({}, amx_int8=True)  # no file type said: not taken for quantised
    assert repack_crashes(q8._llm.metadata) == ("AMX_INT8 = 1" in system_info())  # this machine's own answer
    assert q8.embed(TEXTS).vectors.shape == (len(TEXTS), spec.dim)
