"""Tokenizers behind one interface: raw UTF-8 bytes, sentencepiece, Hugging Face `tokenizers`
(a tokenizer.json), GPT-2 BPE from vocab.json + merges.txt, and Megatron's null tokenizer.

    tok = build_tokenizer("byte")                                   # ids 0..255 bytes, 256 BOS, 257 EOS=EOD, 258 PAD
    tok = build_tokenizer("sentencepiece", "tok.model")
    tok = build_tokenizer("huggingface", "Llama-3-8B/")             # a folder holding tokenizer.json, or the file
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    tok = build_tokenizer("NullTokenizer", vocab_size=32000)        # text is space-separated token ids
    ids = tok.encode("hello"); tok.decode(ids) == "hello"
    tok.encode("a <|endoftext|> b")                        # text as text: the special token's spelling is text
    tok.encode("<|im_start|>user\n", parse_special=True)   # special tokens spelled in text become their ids
    tok.special_tokens, tok.spells_special(text)            # {spelling: id}; whether text spells one

Kinds: byte, sentencepiece, huggingface, gpt2bpe, null, and Megatron-LM's --tokenizer-type names for
them (HuggingFaceTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer,
GPT2BPETokenizer, NullTokenizer). Every tokenizer encodes as Megatron-LM's of the same name does
(Hugging Face: with the special tokens its post-processor adds, e.g. Llama-3's BOS; sentencepiece:
no BOS) and exposes vocab_size (the true number of ids, before any padding of the model's
vocabulary), bos_id (None when it has none), eos_id, eod_id (the document separator the data
pipeline appends; = EOS), pad_id, encode, encode_batch and decode. EOD and BOS come from the
tokenizer's own files (a Hugging Face folder's tokenizer_config.json, special_tokens_map.json or
config.json; the sentencepiece model) or from `eod=` / `bos=` (a token or an id).

Special tokens spelled in text. `encode(text)` tokenizes text as text for every kind: a document that spells
`<|endoftext|>` gets the ids of those characters, never the EOD id (Megatron-LM's tools/preprocess_data.py
does so for GPT2BPETokenizer and sentencepiece), so data never gains a document boundary or a control token
its text only spelled. `encode(text, parse_special=True)` turns every spelling of a special token into its id,
as Hugging Face tokenizers do by default (and Megatron-LM's HuggingFaceTokenizer with them): for markup that
is special by design, such as a chat template's, whose messages are then encoded as text. The special tokens
are a Hugging Face tokenizer's added tokens marked special, GPT-2's <|endoftext|>, a sentencepiece model's
control and unknown pieces (parsed by splitting the text around them, as Megatron-LM's SentencePieceTokenizer
does); the byte and null tokenizers have none. `spells_special(text)` says whether text spells one.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from megalysses.config.values import KINDS, TokenizerError, canonical_kind  # noqa: F401

# well-known special tokens, tried when a tokenizer.json comes without the files that name them
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|end▁of▁sentence|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|begin▁of▁sentence|>")


class TokenizerFileNotFound(TokenizerError, FileNotFoundError):
    """A tokenizer file that does not exist."""


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: Optional[int]
    eos_id: int
    eod_id: int
    pad_id: int
    special_tokens: Mapping[str, int]

    def encode(self, text: str, parse_special: bool = False) -> list[int]: ...

    def encode_batch(self, texts: list[str], parse_special: bool = False) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def spells_special(self, text: str) -> bool: ...


class _Specials:
    """The special tokens of a tokenizer, by their spelling, and the search for them in text."""

    special_tokens: Mapping[str, int] = MappingProxyType({})
    _spelled: Optional[re.Pattern] = None

    def _set_specials(self, specials: dict[str, int]) -> None:
        self.special_tokens = MappingProxyType(dict(specials))
        names = sorted((s for s in specials if s), key=len, reverse=True)      # the longest spelling first
        self._spelled = re.compile("|".join(map(re.escape, names))) if names else None

    def spells_special(self, text: str) -> bool:
        """Whether `text` spells one of the special tokens (which encode() then tokenizes as text)."""
        return self._spelled is not None and self._spelled.search(text) is not None

    def _split_specials(self, text: str) -> list[tuple[str, Optional[int]]]:
        """text as (piece, None) for text and (spelling, id) for each special token it spells, in order."""
        if self._spelled is None:
            return [(text, None)]
        out, start = [], 0
        for m in self._spelled.finditer(text):
            out += [(text[start:m.start()], None), (m.group(), self.special_tokens[m.group()])]
            start = m.end()
        return out + [(text[start:], None)]


class ByteTokenizer(_Specials):
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=EOD=257, PAD=258 (vocab_size 259). No text spells a special
    token: its special ids are not characters."""

    vocab_size = 259
    bos_id: Optional[int] = 256
    eos_id = 257
    eod_id = 257
    pad_id = 258

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """The ids as a bytes object (each byte is its own id): the fast path for preprocessing."""
        return text.encode("utf-8")

    def encode_batch(self, texts: list[str], parse_special: bool = False) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> Optional[int]:
        return None


def _model_file(path: Optional[str], what: str, flag: str) -> str:
    if not path:
        raise TokenizerError(f"the tokenizer needs a model path, its {what}: pass {flag}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise TokenizerFileNotFound(f"{path}: {what} not found ({flag})")
    return path


class SentencePieceTokenizer(_Specials):
    """A sentencepiece model (see tools/train_tokenizer.py). PAD falls back to EOS when the model has
    no pad piece; EOD is the EOS piece. Its special tokens are its control and unknown pieces (<s>, </s>,
    <unk>, ...), which sentencepiece itself never matches in text."""

    def __init__(self, model_path: str | os.PathLike) -> None:
        import sentencepiece as spm

        path = _model_file(os.fspath(model_path), "sentencepiece model", "--tokenizer-model / data.tokenizer_model")
        if os.path.isdir(path):
            raise TokenizerError(f"{path}: is a directory, not a sentencepiece .model file: pass the .model file "
                                 f"inside it (a folder with tokenizer.json is --tokenizer-type huggingface)")
        self.model_path = path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as err:
            raise TokenizerError(f"{path}: not a sentencepiece model ({str(err).strip()}): pass the .model file "
                                 f"written by tools/train_tokenizer.py or by sentencepiece") from None
        self.vocab_size = int(self.sp.vocab_size())
        bos = int(self.sp.bos_id())
        self.bos_id = bos if bos >= 0 else None
        self.eos_id = int(self.sp.eos_id())
        self.eod_id = self.eos_id
        pad = int(self.sp.pad_id())
        self.pad_id = pad if pad >= 0 else self.eos_id
        self._set_specials({self.sp.id_to_piece(i): i for i in range(self.vocab_size)
                            if self.sp.is_control(i) or self.sp.is_unknown(i)})

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        if parse_special:       # the text between the special tokens encoded on its own, as Megatron-LM does
            return [i for piece, special in self._split_specials(text)
                    for i in ([special] if special is not None else self.sp.encode(piece, out_type=int))]
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], parse_special: bool = False) -> list[list[int]]:
        """Encode many texts in one call, on this thread only (parallelism is the caller's choice)."""
        if parse_special:
            return [self.encode(t, parse_special=True) for t in texts]
        return self.sp.encode(texts, out_type=int, num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> Optional[int]:
        i = int(self.sp.piece_to_id(token))
        return i if self.sp.id_to_piece(i) == token else None


def read_json(path: Path, error: type[Exception] = TokenizerError) -> dict:
    """A JSON file of a tokenizer folder as a dict ({} where it holds no object); `error`, naming the file and
    the fix, where it cannot be read."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{path}: unreadable ({err}): fix or remove the file") from None
    return data if isinstance(data, dict) else {}


def special_token_strings(folder: Path, keys: Sequence[str], error: type[Exception] = TokenizerError
                          ) -> dict[str, str]:
    """The special tokens named by `keys` ("bos_token", ...) as strings, from the folder's tokenizer_config.json,
    then its special_tokens_map.json."""
    found: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            data = read_json(folder / name, error)
            for key in keys:
                token = _token_name(data.get(key))
                if token is not None:
                    found.setdefault(key, token)
    return found


def _token_name(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(_Specials):
    """A Hugging Face `tokenizers` tokenizer: tokenizer.json, or a folder holding it (special tokens are
    read from the folder's tokenizer_config.json / special_tokens_map.json / config.json). Encodes as
    Megatron-LM's HuggingFaceTokenizer (`AutoTokenizer(text).input_ids`): with the special tokens the
    post-processor adds, unless add_special_tokens is False; special tokens spelled in the text are text
    (the library's encode_special_tokens) unless parse_special, which parses them as that tokenizer does."""

    def __init__(self, path: str | os.PathLike, add_special_tokens: bool = True) -> None:
        from tokenizers import Tokenizer as _HF

        path = os.fspath(path)
        if not os.path.exists(path) and path.count("/") == 1 and not path.startswith("."):
            raise TokenizerFileNotFound(f"{path}: no such file or folder; Hugging Face Hub names are not fetched "
                                        f"here: download the tokenizer first (huggingface-cli download {path} "
                                        f"tokenizer.json tokenizer_config.json --local-dir DIR) and pass DIR")
        path = _model_file(path, "Hugging Face tokenizer.json (or its folder)",
                           "--tokenizer-model / data.tokenizer_model")
        folder = Path(path) if os.path.isdir(path) else Path(path).parent
        file = Path(path) / "tokenizer.json" if os.path.isdir(path) else Path(path)
        if not file.is_file():
            hint = ("it holds tokenizer.model: use --tokenizer-type sentencepiece with that file"
                    if (folder / "tokenizer.model").is_file() else
                    "it holds vocab.json and merges.txt: use --tokenizer-type GPT2BPETokenizer --vocab-file "
                    "--merge-file" if (folder / "vocab.json").is_file() else
                    "download the model's tokenizer files into it (e.g. huggingface-cli download NAME tokenizer.json "
                    "tokenizer_config.json)")
            raise TokenizerError(f"{path}: no tokenizer.json in this folder; {hint}")
        try:
            tok = _HF.from_file(str(file))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise TokenizerError(f"{file}: not a Hugging Face tokenizer.json ({err}): pass the tokenizer.json "
                                 f"of the model, or the folder holding it") from None
        self.path = str(file)
        self._setup(tok, add_special_tokens, self._special_tokens(folder if os.path.isdir(path) or
                                                                   file.name == "tokenizer.json" else None))

    def _setup(self, tok: Any, add_special_tokens: bool, special: dict[str, Any]) -> None:
        self.tok, self.add_special_tokens, self._parsing = tok, add_special_tokens, None
        self._set_specials({t.content: int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special})
        tok.encode_special_tokens = True              # text is text: a special token's spelling is its characters
        vocab = tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise TokenizerError(f"{self.path}: the tokenizer has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1

        def resolve(key: str, names: Sequence[str]) -> Optional[int]:
            value = special.get(key)
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int) and 0 <= value < self.vocab_size:
                return value
            for name in ([value] if isinstance(value, str) else []) + list(names):
                i = tok.token_to_id(name)
                if i is not None:
                    return int(i)
            return None

        self.eos_id = resolve("eos", _EOS_NAMES)
        if self.eos_id is None:
            self.eos_id = resolve("sep", ())
        self.bos_id = resolve("bos", _BOS_NAMES)
        self.eod_id = self.eos_id
        pad = resolve("pad", ())
        self.pad_id = pad if pad is not None else self.eos_id

    @staticmethod
    def _special_tokens(folder: Optional[Path]) -> dict[str, Any]:
        """bos/eos/sep/pad as token strings or ids, from the files a Hugging Face folder keeps them in."""
        if folder is None:
            return {}
        strings = special_token_strings(folder, ("bos_token", "eos_token", "sep_token", "pad_token"))
        found: dict[str, Any] = {key.removesuffix("_token"): token for key, token in strings.items()}
        for name in ("generation_config.json", "config.json"):
            if (folder / name).is_file():
                data = read_json(folder / name)
                for key in ("bos", "eos", "pad"):
                    value = data.get(f"{key}_token_id")
                    if isinstance(value, (int, list)) and not isinstance(value, bool):
                        found.setdefault(key, value)
        return found

    def _encoder(self, parse_special: bool) -> Any:
        """The tokenizer that encodes text as text, or (a copy made on first use) the one that parses the special
        tokens spelled in it."""
        if not parse_special:
            return self.tok
        if self._parsing is None:
            from tokenizers import Tokenizer as _HF

            self._parsing = _HF.from_str(self.tok.to_str())
            self._parsing.encode_special_tokens = False
        return self._parsing

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        return self._encoder(parse_special).encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_batch(self, texts: list[str], parse_special: bool = False) -> list[list[int]]:
        return [e.ids for e in self._encoder(parse_special).encode_batch(texts,
                                                                         add_special_tokens=self.add_special_tokens)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.tok.token_to_id(token)
        return None if i is None else int(i)


class GPT2BPETokenizer(HFTokenizer):
    """GPT-2's byte-level BPE from vocab.json + merges.txt (Megatron-LM's GPT2BPETokenizer): EOD is
    <|endoftext|>, no special tokens are added; <|endoftext|> spelled in text is text, as Megatron-LM's
    encodes it, unless parse_special."""

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str]) -> None:
        from tokenizers import Tokenizer as _HF
        from tokenizers import decoders, models, pre_tokenizers

        vocab = _model_file(vocab_file, "GPT-2 vocab.json", "--vocab-file / data.vocab_file")
        merges = _model_file(merge_file, "GPT-2 merges.txt", "--merge-file / data.merge_file")
        try:
            tok = _HF(models.BPE.from_file(vocab, merges))
        except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise TokenizerError(f"{vocab} / {merges}: not a GPT-2 vocab.json and merges.txt ({err})") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id("<|endoftext|>") is not None:
            tok.add_special_tokens(["<|endoftext|>"])
        self.path, self.merge_file = vocab, merges
        self._setup(tok, False, {"eos": "<|endoftext|>"})


class NullTokenizer(_Specials):
    """Megatron-LM's NullTokenizer: the text is already token ids separated by spaces; EOD is
    vocab_size - 1 unless given."""

    bos_id: Optional[int] = None

    def __init__(self, vocab_size: Optional[int]) -> None:
        if vocab_size is None or vocab_size < 1:
            raise TokenizerError(f"the null tokenizer needs the vocabulary size (--vocab-size N), got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eos_id = self.eod_id = self.pad_id = self.vocab_size - 1

    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise TokenizerError(f"null tokenizer: the text {text[:40]!r} is not space-separated integer token "
                                 f"ids") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"null tokenizer: token id {bad[0]} is outside [0, {self.vocab_size}) "
                                 f"(--vocab-size {self.vocab_size})")
        return ids

    def encode_batch(self, texts: list[str], parse_special: bool = False) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def token_to_id(self, token: str) -> Optional[int]:
        return None


def _special_id(tok: Any, value: str | int, what: str) -> int:
    """A token of the vocabulary ('<|end_of_text|>') or an id ('128001', 128001) -> its id."""
    if isinstance(value, int) or str(value).strip().lstrip("-").isdigit():
        i: Optional[int] = int(value)
    else:
        i = tok.token_to_id(str(value))
        if i is None:
            raise TokenizerError(f"{what} {value!r}: no such token in the tokenizer's vocabulary; give a token of "
                                 f"it or an id")
    if not 0 <= i < tok.vocab_size:
        raise TokenizerError(f"{what} {value!r}: id {i} is outside the tokenizer's vocabulary [0, {tok.vocab_size})")
    return i


@dataclass(frozen=True)
class SpecialTokens:
    """The end-of-document and beginning-of-sequence tokens a run names in place of the tokenizer's own: a token
    or an id each, None keeping the tokenizer's (data.eod, data.bos; preprocessing's --eod, --bos)."""

    eod: Optional[str | int] = None
    bos: Optional[str | int] = None


def build_tokenizer(kind: str, model_path: Optional[str] = None, *, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, vocab_size: Optional[int] = None,
                    special: SpecialTokens = SpecialTokens(), add_special_tokens: bool = True,
                    need_eod: bool = True) -> Any:
    """A tokenizer of `kind` (see KINDS; Megatron-LM names accepted). `model_path` is the sentencepiece
    .model or the tokenizer.json (or its folder); gpt2bpe takes vocab_file and merge_file, null takes
    vocab_size. `special` replaces the tokenizer's own EOD / BOS. With need_eod a tokenizer that cannot tell
    its end-of-document token is refused. Raises TokenizerError."""
    kind = canonical_kind(kind)
    if kind == "byte":
        tok: Any = ByteTokenizer()
    elif kind == "sentencepiece":
        tok = SentencePieceTokenizer(_model_file(model_path, "sentencepiece model",
                                                 "--tokenizer-model / data.tokenizer_model"))
    elif kind == "huggingface":
        if not model_path:
            raise TokenizerError("the Hugging Face tokenizer needs a model path: pass --tokenizer-model / "
                                 "data.tokenizer_model (a tokenizer.json or the folder holding it)")
        tok = HFTokenizer(model_path, add_special_tokens)
    elif kind == "gpt2bpe":
        tok = GPT2BPETokenizer(vocab_file, merge_file)
    else:
        tok = NullTokenizer(vocab_size)
    if special.eod is not None:
        tok.eod_id = _special_id(tok, special.eod, "EOD token")
    if special.bos is not None:
        tok.bos_id = _special_id(tok, special.bos, "BOS token")
    if need_eod and (tok.eod_id is None or tok.eod_id < 0):
        raise TokenizerError(f"{getattr(tok, 'path', kind)}: cannot tell which token ends a document (no EOS in "
                             f"the tokenizer or the files beside it): name it with --eod TOKEN (preprocessing) or "
                             f"data.eod (training)")
    if tok.pad_id is None or tok.pad_id < 0:
        tok.pad_id = tok.eod_id
    return tok


def tokenizer_from_config(data: Any, model_vocab_size: Optional[int] = None) -> Any:
    """The tokenizer a DataConfig names (data.tokenizer, tokenizer_model, vocab_file, merge_file, eod, bos);
    the null tokenizer's vocabulary is the model's."""
    return build_tokenizer(data.tokenizer, data.tokenizer_model, vocab_file=data.vocab_file,
                           merge_file=data.merge_file, vocab_size=model_vocab_size,
                           special=SpecialTokens(data.eod, data.bos))
