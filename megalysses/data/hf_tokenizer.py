"""A run's tokenizer as Hugging Face tokenizer files that transformers' AutoTokenizer loads and that encode
text to the ids the run trained on: a sentencepiece model (BPE or unigram, with or without its dummy prefix,
its normalisation, byte fallback, user-defined pieces), the byte tokenizer and GPT-2 BPE, each rebuilt as a
`tokenizers` tokenizer.json beside a tokenizer_config.json naming its special tokens.

    files = hf_tokenizer_files(tok, model_max_length=4096)   # {"tokenizer.json": b"...", "tokenizer_config.json": ...}

Every conversion is checked before it is returned: probe texts (code, prose, runs of spaces, tabs, digits,
accents, CJK, an emoji) must encode to the same ids both ways, else TokenizerError says where they part.
A Hugging Face tokenizer needs no conversion (its own files go), nor does the null tokenizer have one.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Optional

from megalysses.data.tokenizer import ByteTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, TokenizerError

SPACE = "\u2581"      # sentencepiece's whitespace symbol
PROBES = ("def f(x):\n    return x  * 2   # spaces\n\tand a tab\n",
          " a leading space, trailing ones  ",
          "Digits 1234567890, émigré café naïve, 日本語のテキスト, an emoji 🙂 and ✓ marks.",
          "x")
# sentencepiece's piece types (sentencepiece_model.proto)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2


# ----------------------------------------------------------------------------- the sentencepiece model file

def _fields(buf: bytes) -> dict[int, list]:
    """{field number: [values]} of one protobuf message: varints as ints, 32-bit values as bytes, length-
    delimited ones as bytes (the few fields read here, off the wire format, so that no protobuf runtime
    of one generation or another is needed)."""
    out: dict[int, list] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise TokenizerError(f"the sentencepiece model has a protobuf field of wire type {wire}, which is not "
                                 f"read here")
        out.setdefault(number, []).append(value)
    return out


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


def sentencepiece_spec(serialized: bytes) -> dict[str, Any]:
    """What a sentencepiece ModelProto says of encoding: its pieces [(piece, score, type)], model type,
    byte fallback, and its normaliser (name, precompiled character map, dummy prefix, extra whitespace
    removed, whitespace escaped), with the proto's defaults for fields left out."""
    model = _fields(serialized)
    pieces = []
    for raw in model.get(1, []):
        p = _fields(raw)
        pieces.append((p[1][0].decode("utf-8") if 1 in p else "",
                       struct.unpack("<f", p[2][0])[0] if 2 in p else 0.0, p.get(3, [NORMAL])[0]))
    trainer = _fields(model[2][0]) if 2 in model else {}
    norm = _fields(model[3][0]) if 3 in model else {}
    return {"pieces": pieces, "model_type": trainer.get(3, [UNIGRAM])[0],
            "byte_fallback": bool(trainer.get(35, [0])[0]), "treat_whitespace_as_suffix": bool(trainer.get(24, [0])[0]),
            "name": norm[1][0].decode() if 1 in norm else "", "charsmap": norm.get(2, [b""])[0],
            "add_dummy_prefix": bool(norm.get(3, [1])[0]), "remove_extra_whitespaces": bool(norm.get(4, [1])[0]),
            "escape_whitespaces": bool(norm.get(5, [1])[0])}


# ----------------------------------------------------------------------------- conversions

def _sentencepiece(tok: SentencePieceTokenizer) -> tuple[Any, dict[str, Optional[str]]]:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

    spec = sentencepiece_spec(tok.sp.serialized_model_proto())
    if spec["model_type"] not in (UNIGRAM, BPE):
        raise TokenizerError(f"{tok.model_path}: a sentencepiece word or char model is not converted (BPE and unigram "
                             f"models are)")
    if spec["treat_whitespace_as_suffix"]:
        raise TokenizerError(f"{tok.model_path}: a sentencepiece model that treats whitespace as a suffix is not "
                             f"converted")
    pieces = spec["pieces"]
    unk = next((i for i, (_, _, t) in enumerate(pieces) if t == UNKNOWN), None)
    if spec["model_type"] == UNIGRAM:
        model = models.Unigram([(p, s) for p, s, _ in pieces], unk, spec["byte_fallback"])
    else:
        vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
        mergeable = {p for p, _, t in pieces if t in (NORMAL, USER_DEFINED)}
        # sentencepiece merges the adjacent pair whose merged piece scores highest: the merges in that order
        merges = sorted(((-s, i, p[:k], p[k:]) for i, (p, s, t) in enumerate(pieces) if t == NORMAL
                         for k in range(1, len(p)) if p[:k] in mergeable and p[k:] in mergeable))
        model = models.BPE(vocab, [(a, b) for _, _, a, b in merges], unk_token=None if unk is None else pieces[unk][0],
                           fuse_unk=True, byte_fallback=spec["byte_fallback"])
    out = Tokenizer(model)
    steps = [normalizers.Precompiled(spec["charsmap"])] if spec["charsmap"] and spec["name"] != "identity" else []
    if spec["remove_extra_whitespaces"]:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex("^ | $"), "")]
    if spec["add_dummy_prefix"]:
        steps.append(normalizers.Prepend(SPACE))
    if spec["escape_whitespaces"]:
        steps.append(normalizers.Replace(" ", SPACE))
    if steps:
        out.normalizer = normalizers.Sequence(steps)
    out.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if spec["add_dummy_prefix"] else []))
    # control pieces (BOS, EOS, PAD) are special tokens; user-defined ones match whole, wherever they appear
    out.add_special_tokens([AddedToken(p, special=True, normalized=False) for p, _, t in pieces
                            if t in (CONTROL, UNKNOWN)])
    out.add_tokens([AddedToken(p, special=False, normalized=False) for p, _, t in pieces if t == USER_DEFINED])

    def name(i: Optional[int]) -> Optional[str]:
        return pieces[i][0] if i is not None and 0 <= i < len(pieces) else None
    return out, {"bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id), "unk_token": name(unk),
                 "pad_token": name(tok.pad_id)}


def _bytes() -> tuple[Any, dict[str, Optional[str]]]:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    names = {ByteTokenizer.bos_id: "<s>", ByteTokenizer.eos_id: "</s>", ByteTokenizer.pad_id: "<pad>"}
    vocab = {**{f"<0x{b:02X}>": b for b in range(256)}, **{n: i for i, n in names.items()}}
    out = Tokenizer(models.BPE(vocab, [], byte_fallback=True))     # no merges: every byte is its own id
    out.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    out.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names.values()])
    return out, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None, "pad_token": "<pad>"}


def hf_tokenizer_files(tok: Any, model_max_length: Optional[int] = None) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json for a sentencepiece, byte or GPT-2 BPE tokenizer (as built by
    megalysses.data.tokenizer), checked to encode the probe texts to the ids `tok` gives. TokenizerError for
    another kind, and for a conversion that does not encode as `tok` does (naming the first probe it fails)."""
    if isinstance(tok, SentencePieceTokenizer):
        converted, special = _sentencepiece(tok)
    elif isinstance(tok, ByteTokenizer):
        converted, special = _bytes()
    elif isinstance(tok, GPT2BPETokenizer):
        converted = tok.tok
        special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": None,
                   "pad_token": "<|endoftext|>"}
    else:
        raise TokenizerError(f"a {type(tok).__name__} is not converted to Hugging Face tokenizer files")
    for text in PROBES:
        want, got = tok.encode(text), converted.encode(text, add_special_tokens=False).ids
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise TokenizerError(f"the tokenizer.json built from {getattr(tok, 'model_path', 'the run tokenizer')} "
                                 f"encodes {text!r} differently from it (ids {want[at:at + 4]} against "
                                 f"{got[at:at + 4]} at token {at})")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in special.items() if v is not None},
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    if model_max_length:
        config["model_max_length"] = model_max_length
    return {"tokenizer.json": converted.to_str().encode(),
            "tokenizer_config.json": (json.dumps(config, indent=1, ensure_ascii=False) + "\n").encode()}


def source_name(tok: Any) -> str:
    """The file a tokenizer was read from, in words."""
    return str(Path(getattr(tok, "model_path", None) or getattr(tok, "path", None) or type(tok).__name__))
