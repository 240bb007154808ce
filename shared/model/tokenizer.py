"""Tokenizers: a char-level one for the tiny model, built with `tokenizers` so any HF tokenizer.json loads alike."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

CHARSET = "0123456789+-=*/:;,.?!()[] abcdefghijklmnopqrstuvwxyz\n"
SPECIAL_TOKENS = ("<pad>", "<eos>")
# transformers' Qwen2Tokenizer pre-split (before its byte-level mapping), which the char tokenizer shares
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# besides tokenizer.json: what a checkpoint ships for its tokenizer, kept byte for byte through every publish
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the ids the engine and trainer need."""

    def __init__(self, tokenizer: HFTokenizer, eos_token: str, pad_token: str | None = None,
                 files: dict[str, str] | None = None) -> None:
        self.backend = tokenizer
        self.files = dict(files or {})  # the tokenizer-side files it was loaded with, written back as they were
        self.eos_token = eos_token
        self.pad_token = pad_token or eos_token
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer has no eos token {eos_token!r}")
        self.eos_id = eos_id
        pad_id = tokenizer.token_to_id(self.pad_token)
        self.pad_id = eos_id if pad_id is None else pad_id
        model = json.loads(tokenizer.to_str())["model"]  # a character vocabulary, as build_char_tokenizer's
        self.is_closed_alphabet = (model["type"] == "BPE" and not model["merges"] and model["unk_token"] is None
                                   and not model["byte_fallback"])

    @property
    def chat_template(self) -> str | None:
        """The template the checkpoint ships: chat_template.jinja, else tokenizer_config.json's `chat_template`
        (a string, or named templates of which `default` is the one)."""
        if "chat_template.jinja" in self.files:
            return self.files["chat_template.jinja"]
        template = json.loads(self.files.get("tokenizer_config.json", "{}")).get("chat_template")
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, pad_token ... as tokenizer_config.json names them: a chat template's variables."""
        meta = json.loads(self.files.get("tokenizer_config.json", "{}"))
        tokens = {"eos_token": self.eos_token, "pad_token": self.pad_token}
        for key, value in meta.items():
            if key.endswith("_token") and value is not None:
                tokens[key] = value.get("content", "") if isinstance(value, dict) else value
        return tokens

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        # a character vocabulary drops what it lacks: refuse the text rather than train on less of it
        if self.is_closed_alphabet and (decoded := self.backend.decode(ids, skip_special_tokens=False)) != text:
            missing = "".join(sorted(set(text) - set(decoded)))
            raise ValueError(f"the tokenizer has no token for {missing!r} (in {text[:80]!r})")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        """tokenizer.json, and the other tokenizer files as loaded (the chat template among them), so every
        version published from a checkpoint keeps them; a tokenizer built here gets a tokenizer_config.json."""
        directory = Path(directory)
        # written by Python, not by the tokenizers library: its writer reports a full disk as a bare Exception
        (directory / "tokenizer.json").write_text(self.backend.to_str(pretty=True))
        meta = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "model_max_length": 1 << 30,
        }
        for name, text in {"tokenizer_config.json": json.dumps(meta, indent=2), **self.files}.items():
            (directory / name).write_text(text)


def write_bpe_tokenizer(directory: Path, corpus: list[str], vocab_size: int, special_tokens: list[str],
                        config: dict[str, str]) -> int:
    """Train a byte-level BPE on `corpus` (digits one by one, as Qwen2's tokenizer splits them, so arithmetic stays
    digit-wise) and write it to `directory` with `config` as its tokenizer_config.json; returns its vocabulary size."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return backend.get_vocab_size()


def build_char_tokenizer() -> Tokenizer:
    """Char-level vocabulary: the special tokens, then one token per character of CHARSET. It is written as a
    byte-level BPE without merges, the pipeline transformers 5 imposes on every `qwen2` model's tokenizer
    (Qwen2Tokenizer), so `AutoTokenizer` on a published version encodes and decodes as jetroll does: each character
    is its byte-level symbol (" " is "Ġ", "\\n" is "Ċ"), and its id is its place in CHARSET."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab[byte_level.pre_tokenize_str(ch)[0][0]] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                     byte_level])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return Tokenizer(backend, eos_token="<eos>", pad_token="<pad>")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load tokenizer.json (+ tokenizer_config.json for the eos token) from an HF-format directory."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(path))
    files = {name: (model_dir / name).read_text() for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    meta = json.loads(files.get("tokenizer_config.json", "{}"))
    eos = meta.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        config = json.loads((model_dir / "config.json").read_text())
        eos = backend.id_to_token(int(config["eos_token_id"]))
    pad = meta.get("pad_token")
    if isinstance(pad, dict):
        pad = pad.get("content")
    return Tokenizer(backend, eos_token=eos, pad_token=pad, files=files)
