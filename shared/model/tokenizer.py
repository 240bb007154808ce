"""Tokenizers: a char-level one for the tiny model, built with `tokenizers` so any HF tokenizer.json loads alike."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

CHARSET = "0123456789+-=*/:;,.?!()[] abcdefghijklmnopqrstuvwxyz\n"
SPECIAL_TOKENS = ("<pad>", "<eos>")


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the ids the engine and trainer need."""

    def __init__(self, tokenizer: HFTokenizer, eos_token: str, pad_token: str | None = None) -> None:
        self.backend = tokenizer
        self.eos_token = eos_token
        self.pad_token = pad_token or eos_token
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer has no eos token {eos_token!r}")
        self.eos_id = eos_id
        pad_id = tokenizer.token_to_id(self.pad_token)
        self.pad_id = eos_id if pad_id is None else pad_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        meta = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "model_max_length": 1 << 30,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(meta, indent=2))


def build_char_tokenizer() -> Tokenizer:
    """Char-level vocabulary: the special tokens, then one token per character of CHARSET."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab[ch] = len(vocab)
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return Tokenizer(backend, eos_token="<eos>", pad_token="<pad>")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load tokenizer.json (+ tokenizer_config.json for the eos token) from an HF-format directory."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(path))
    meta_path = model_dir / "tokenizer_config.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    eos = meta.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        config = json.loads((model_dir / "config.json").read_text())
        eos = backend.id_to_token(int(config["eos_token_id"]))
    pad = meta.get("pad_token")
    if isinstance(pad, dict):
        pad = pad.get("content")
    return Tokenizer(backend, eos_token=eos, pad_token=pad)
