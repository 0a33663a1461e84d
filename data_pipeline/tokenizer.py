"""Tokenizers: SentencePiece (trained on a sample of the sources, or given) or a Hugging Face
``tokenizer.json`` (the ``tokenizers`` library; an open-weights model's own); loading, and
identity (the sha256 of the file's bytes)."""

from __future__ import annotations

import hashlib
import io
import random
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import sentencepiece as spm

from data_pipeline.config import MIN_VOCAB, TokenizerConfig
from data_pipeline.errors import DataError

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
TOKENIZER_FILE = "tokenizer.model"
"""The tokenizer's file name in prepared data (and in a parts directory), whatever its kind."""
TRAINER_THREADS = 16
"""Threads of SentencePiece's trainer (its own default), the same whatever data.prepare_workers
says: the model stores the count, and the unigram trainer sums its statistics per thread, so
another count gives other scores. The tokenizer, the data fingerprint and the sample order
must not depend on how many workers prepared the data."""


SURROGATE = re.compile("[\ud800-\udfff]")


def without_surrogates(text: str) -> tuple[str, int]:
    """``text`` with each surrogate code point replaced by U+FFFD, and how many were replaced.
    JSON escapes (``"\\ud800"``), Python literals and YAML allow lone surrogates; UTF-8 has no
    form for them, so SentencePiece, ``tokenizers`` and strict encoding refuse them. Checked by
    encoding, a copy at memory speed (well under 1% of tokenizing the same text)."""
    if text.isascii():
        return text, 0
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return SURROGATE.subn("\ufffd", text)
    return text, 0


def utf8_texts(texts: Iterable[str]) -> list[str]:
    """Texts a tokenizer takes: each lone surrogate replaced by U+FFFD (one character for one,
    so character offsets stay those of the texts given)."""
    return [without_surrogates(text)[0] for text in texts]


# Special tokens of a tokenizer.json, by the names open-weights models use for them.
HF_SPECIALS = {
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>"),
    "pad": ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>"),
    "unk": ("<unk>", "<|unk|>"),
}


class Tokenizer:
    """A SentencePiece model or a Hugging Face ``tokenizer.json``, told apart by content (the
    prepared data keeps either under one file name)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read tokenizer {self.path}: {e.strerror}") from e
        if data.lstrip()[:1] == b"{":
            self._load_json(data)
            return
        self.hf = None
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{self.path} is not a valid SentencePiece model: {e}") from e
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size = self.sp.GetPieceSize()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        self.pad_id, self.unk_id = self.sp.pad_id(), self.sp.unk_id()
        if self.eos_id < 0:
            raise DataError(f"tokenizer {self.path} defines no EOS piece; documents need one")

    def _load_json(self, data: bytes) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.hf = HFTokenizer.from_str(data.decode())
        except Exception as e:  # tokenizers raises its own exception type
            raise DataError(
                f"{self.path} is neither a SentencePiece model nor a valid tokenizer.json: {e}"
            ) from e
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
        ids = {
            kind: next((i for name in names if (i := self.hf.token_to_id(name)) is not None), -1)
            for kind, names in HF_SPECIALS.items()
        }
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (
            ids["bos"],
            ids["eos"],
            ids["pad"],
            ids["unk"],
        )
        if self.eos_id < 0:
            raise DataError(
                f"tokenizer {self.path} has none of the EOS tokens "
                f"{', '.join(HF_SPECIALS['eos'])}; documents need one"
            )

    def encode(self, text: str) -> list[int]:
        text = without_surrogates(text)[0]
        if self.hf is not None:
            return self.hf.encode(text, add_special_tokens=False).ids
        return self.sp.EncodeAsIds(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        texts = utf8_texts(texts)
        if self.hf is not None:
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        # One thread: preparation parallelizes over processes.
        return self.sp.Encode(texts, num_threads=1)

    def encode_spans(self, texts: list[str]) -> list[tuple[list[int], np.ndarray]]:
        """Token ids of each text and, per token, the characters of the text it covers as an
        (N, 2) array of [start, end) offsets (a piece of no text, such as SentencePiece's
        dummy-prefix space or the first byte piece of a character, has start == end)."""
        texts = utf8_texts(texts)
        if self.hf is not None:
            return [
                (e.ids, np.array(e.offsets, dtype=np.int64).reshape(-1, 2))
                for e in self.hf.encode_batch(texts, add_special_tokens=False)
            ]
        out = []
        for text, proto in zip(texts, self.sp.Encode(texts, return_type="proto", num_threads=1)):
            ids, spans = [], []
            for piece in proto.pieces:
                ids.append(piece.id)
                spans.append((piece.begin, piece.end))
            # SentencePiece counts UTF-8 bytes: char_at[b] is the character byte b starts.
            raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            char_at = np.concatenate([[0], np.cumsum((raw & 0xC0) != 0x80)])
            out.append((ids, char_at[np.array(spans, dtype=np.int64).reshape(-1, 2)]))
        return out

    def id_to_piece(self, i: int) -> str:
        if self.hf is not None:
            return self.hf.id_to_token(int(i)) or ""
        return self.sp.IdToPiece(int(i))

    def decode(self, ids: Iterable[int]) -> str:
        if self.hf is not None:
            return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)
        return self.sp.DecodeIds([int(i) for i in ids])

    def describe(self) -> dict:
        return {
            "file": self.path.name,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "unk_id": self.unk_id,
        }


class LineSample:
    """A uniform, seeded sample of at most ``size`` non-empty lines of a stream of texts
    (reservoir sampling: memory stays ``size`` lines whatever the corpus size)."""

    def __init__(self, size: int, seed: int):
        self.size, self.seen, self.lines = size, 0, []
        self._rng = random.Random(seed)

    def add(self, text: str) -> None:
        for line in text.splitlines():
            if not line.strip():
                continue
            self.seen += 1
            if len(self.lines) < self.size:
                self.lines.append(line)
            else:
                j = self._rng.randrange(self.seen)
                if j < self.size:
                    self.lines[j] = line


def train_tokenizer(lines: list[str], cfg: TokenizerConfig, out_path: Path) -> Tokenizer:
    """Train a SentencePiece model on sampled lines (with TRAINER_THREADS threads: the model's
    bytes depend on the lines and ``cfg`` alone); write it atomically to ``out_path``."""
    if not lines:
        raise DataError("cannot train a tokenizer: the sources hold no text")
    model = io.BytesIO()
    try:
        _train(lines, cfg, model)
    except RuntimeError as e:  # SentencePiece's checks of the vocabulary against the corpus
        raise DataError(_training_problem(str(e), cfg.vocab_size)) from None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_bytes(model.getvalue())
    tmp.replace(out_path)
    return Tokenizer(out_path)


def _training_problem(message: str, vocab_size: int) -> str:
    """SentencePiece's refusal (``INTERNAL: file(line) [check] what``) as the config's terms."""
    what = message.rsplit("] ", 1)[-1].strip()
    what = what.replace(" or decrease character_coverage with --character_coverage option", "")
    fix = ""
    if m := re.search(r"smaller than required_chars\. (\d+) vs (\d+)", what):
        fix = f"; set data.tokenizer.vocab_size to at least {m.group(2)}"
    elif m := re.search(r"too high \((\d+)\)\. Please set it to a value <= (\d+)", what):
        most = int(m.group(2))
        fix = (
            f"; set data.tokenizer.vocab_size to at most {most}, or add text"
            if most >= MIN_VOCAB
            else f"; the text is too small for the least vocab_size, {MIN_VOCAB}: add text"
        )
    return (
        f"data.tokenizer.vocab_size {vocab_size}: SentencePiece cannot train a tokenizer of "
        f"this size on the sampled text ({what}){fix}"
    )


def _train(lines: list[str], cfg: TokenizerConfig, model: io.BytesIO) -> None:
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(utf8_texts(lines)),
        model_writer=model,
        vocab_size=cfg.vocab_size,
        model_type=cfg.model_type,
        byte_fallback=cfg.byte_fallback,
        character_coverage=0.9995,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        num_threads=TRAINER_THREADS,
        max_sentence_length=16384,
        shuffle_input_sentence=False,
        minloglevel=2,
        user_defined_symbols=list(cfg.special_tokens),
        normalization_rule_name=cfg.normalization,
        remove_extra_whitespaces=cfg.normalization != "identity",
    )
