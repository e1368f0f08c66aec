"""Convert a sentence-transformers BERT checkpoint (safetensors + WordPiece vocab) to GGUF.

llama.cpp's own converter (convert_hf_to_gguf.py, class BertModel) needs torch and
transformers; this one needs only numpy, safetensors and gguf, and follows it decision by
decision so the file llama.cpp loads is the one its converter would have written:

* architecture "bert", hyperparameters from config.json, non-causal attention, pooling type
  from the sentence-transformers Pooling module;
* tensor names through gguf's own BERT name map; 2-D weights as f16, while 1-D tensors, norms,
  position and token-type embeddings stay f32 (llama.cpp keeps those in f32);
* the WordPiece vocab in llama.cpp's "phantom space" form: a word-initial piece gets a U+2581
  prefix, a "##" continuation loses its "##", control tokens stay as they are;
* special token ids through gguf.SpecialVocab, exactly as the converter adds them.
"""

from __future__ import annotations

import json
import pathlib

import gguf
import numpy as np
from safetensors import safe_open

# convert_hf_to_gguf.py names the pre-tokenizer by hashing the tokenizer's output on a fixed
# text. The uncased BERT WordPiece tokenizer hashes to 0876d13b…, which its table lists for
# bge-small-en-v1.5 ("bert-bge") and then jina-embeddings-v2-base-en ("jina-v2-en"); the later
# assignment wins. llama.cpp ignores the value for WordPiece vocabularies; we write it for parity.
# bench/check_minilm_reference.py recomputes the hash.
UNCASED_BERT_PRE = "jina-v2-en"

_SKIPPED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
_F32_TENSORS = (gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.TOKEN_TYPES)


class ConversionError(ValueError):
    """The checkpoint is not a BERT model this converter handles."""


def _json(path: pathlib.Path) -> dict | list:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pooling_type(model_dir: pathlib.Path) -> gguf.PoolingType | None:
    """From modules.json → the Pooling module's config, as the converter reads it."""
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return None
    for mod in _json(modules):
        if mod["type"] == "sentence_transformers.models.Pooling":
            pooling = _json(model_dir / mod["path"] / "config.json")
            if pooling.get("pooling_mode_mean_tokens"):
                return gguf.PoolingType.MEAN
            if pooling.get("pooling_mode_cls_token"):
                return gguf.PoolingType.CLS
            raise ConversionError("only mean and CLS pooling are supported")
    return None


def _vocab(model_dir: pathlib.Path, n_vocab: int) -> tuple[list[str], list[int], dict]:
    """Tokens (phantom-space form) and token types, plus the tokenizer.json normalizer."""
    tok = _json(model_dir / "tokenizer.json")
    model = tok["model"]
    if model.get("type") != "WordPiece" or model.get("continuing_subword_prefix", "##") != "##":
        raise ConversionError("tokenizer is not a '##' WordPiece tokenizer")
    by_id = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        t = by_id[i]
        if i in added:
            if added[i]["special"]:
                tokens.append(t)  # control tokens keep their text: no phantom space
                types.append(gguf.TokenType.CONTROL)
                continue
            t = t.replace("\u2581", " ")  # the converter pre-normalises user-defined tokens
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(t[2:] if t.startswith("##") else "\u2581" + t)
    return tokens, types, tok.get("normalizer") or {}


def convert(model_dir: str | pathlib.Path, out: str | pathlib.Path, *, name: str = "", license: str = "") -> None:
    """Write `out` (GGUF, mostly f16) from the checkpoint in `model_dir`."""
    model_dir = pathlib.Path(model_dir)
    hp = _json(model_dir / "config.json")
    if hp.get("model_type") != "bert" and "BertModel" not in hp.get("architectures", []):
        raise ConversionError(f"not a BERT model: {hp.get('architectures')}")
    if hp.get("hidden_act", "gelu") != "gelu" or hp.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError("only gelu activation and absolute position embeddings are supported")
    n_layer = int(hp["num_hidden_layers"])
    n_vocab = int(hp["vocab_size"])

    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    if name:
        w.add_name(name)
    if license:
        w.add_license(license)
    w.add_block_count(n_layer)
    w.add_context_length(int(hp["max_position_embeddings"]))
    w.add_embedding_length(int(hp["hidden_size"]))
    w.add_feed_forward_length(int(hp["intermediate_size"]))
    w.add_head_count(int(hp["num_attention_heads"]))
    w.add_layer_norm_eps(float(hp["layer_norm_eps"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_causal_attention(False)
    if (pooling := _pooling_type(model_dir)) is not None:
        w.add_pooling_type(pooling)

    tokens, types, normalizer = _vocab(model_dir, n_vocab)
    w.add_token_type_count(int(hp.get("type_vocab_size", 1)))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre(UNCASED_BERT_PRE)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, n_vocab=len(tokens))
    # gguf has no key for the CLS id (llama.cpp's BERT uses bos = [CLS]); the converter logs and
    # skips it, we skip it quietly.
    special.special_token_ids = {t: i for t, i in special.special_token_ids.items() if hasattr(w, f"add_{t}_token_id")}
    special.add_to_gguf(w, quiet=True)
    # llama.cpp reads these (defaults: lowercase, strip accents); HF's strip_accents=None means
    # "same as lowercase". Written explicitly so a cased model would not be lowercased.
    lowercase = bool(normalizer.get("lowercase", _json(model_dir / "tokenizer_config.json").get("do_lower_case", True)))
    strip = normalizer.get("strip_accents")
    w.add_bool("tokenizer.ggml.normalizer.lowercase", lowercase)
    w.add_bool("tokenizer.ggml.normalizer.strip_accents", lowercase if strip is None else bool(strip))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_layer)
    f32_names = {gguf.TENSOR_NAMES[t] + ".weight" for t in _F32_TENSORS}
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as st:
        for key in st.keys():
            hf = key.removeprefix("bert.")
            if hf.endswith(".gamma"):
                hf = hf[: -len(".gamma")] + ".weight"
            if hf.endswith(".beta"):
                hf = hf[: -len(".beta")] + ".bias"
            if hf in _SKIPPED or hf.startswith("cls."):
                continue  # pooler and MLM heads: unused for embeddings
            new = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ConversionError(f"unexpected tensor {key!r}")
            data = st.get_tensor(key)
            f32 = data.ndim <= 1 or new.endswith("_norm.weight") or new in f32_names or not new.endswith(".weight")
            w.add_tensor(new, np.ascontiguousarray(data, dtype=np.float32 if f32 else np.float16))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
