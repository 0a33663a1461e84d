"""Instruction data: conversations read from JSONL records, written with a template, tokenized
with a per-token loss mask (1: the token is a trained target; 0: a prompt token, ignored).

A record is ``{"prompt": P, "response": R}`` (a user message then an assistant message) or
``{"messages": [{"role": ..., "content": ...}, ...]}``. Between reading and tokenizing, a
conversation travels as its canonical JSON text (:func:`canonical`): the document text that the
train/validation split and deduplication key on, so a change of template moves no conversation
between the splits.
"""

from __future__ import annotations

import json

import numpy as np

from data_pipeline.config import ROLES, TemplateConfig
from data_pipeline.errors import DataError
from data_pipeline.tokenizer import Tokenizer

Message = tuple[str, str]
"""(role, content)."""


def messages_of(record: object, where: str, train_roles: list[str]) -> list[Message]:
    """The conversation of one JSON record, checked; ``where`` names the file and line in
    errors."""
    if isinstance(record, dict) and "messages" in record:
        raw = record["messages"]
        if not isinstance(raw, list) or not raw:
            raise DataError(
                f"{where}: 'messages' must be a non-empty list of "
                '{"role": ..., "content": ...} objects'
            )
        out = []
        for i, m in enumerate(raw):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise DataError(
                    f"{where}: messages[{i}] must be an object with string fields "
                    "'role' and 'content'"
                )
            if m["role"] not in ROLES:
                raise DataError(
                    f"{where}: messages[{i}] has the unknown role {m['role']!r}; "
                    f"roles are {', '.join(ROLES)}"
                )
            out.append((m["role"], m["content"]))
    elif isinstance(record, dict) and "prompt" in record and "response" in record:
        for name in ("prompt", "response"):
            if not isinstance(record[name], str):
                raise DataError(
                    f"{where}: field {name!r} is {type(record[name]).__name__}, expected a string"
                )
        out = [("user", record["prompt"]), ("assistant", record["response"])]
    else:
        raise DataError(
            f"{where} has neither 'prompt' and 'response' nor 'messages' (an "
            'instruction source reads {"prompt": ..., "response": ...} or '
            '{"messages": [{"role": ..., "content": ...}]} records)'
        )
    trained = [i for i, (role, _) in enumerate(out) if role in train_roles]
    if not trained:
        raise DataError(
            f"{where}: no message of a trained role ({', '.join(train_roles)}): "
            "nothing in it would be trained"
        )
    for i in trained:
        if not out[i][1].strip():
            what = "response" if "messages" not in record else f"messages[{i}] ({out[i][0]})"
            raise DataError(f"{where}: the {what} is empty; a trained message needs text")
    return out


def canonical(messages: list[Message]) -> str:
    """The conversation as one text: compact JSON ``[[role, content], ...]``."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


def parse(text: str) -> list[Message]:
    return [(role, content) for role, content in json.loads(text)]


def segments(messages: list[Message], template: TemplateConfig) -> list[tuple[str, bool]]:
    """(text, trained) pieces of a conversation written with ``template``, in order: each
    message's prefix (never trained), content and suffix (trained when its role is)."""
    out = []
    for role, content in messages:
        written, trained = template.role(role), role in template.train_roles
        out += [(written.prefix, False), (content, trained), (written.suffix, trained)]
    return [(text, trained) for text, trained in out if text]


def render(text: str, template: TemplateConfig) -> str:
    """The conversation ``text`` (:func:`canonical`) as the plain text the template writes: what
    a tokenizer is trained on."""
    return "".join(piece for piece, _ in segments(parse(text), template))


def encode(
    texts: list[str], template: TemplateConfig, tokenizer: Tokenizer
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Token ids (each document ending with EOS, after BOS if the template says so) and their
    loss masks (uint8, one per token) of conversations given as :func:`canonical` texts.

    Each conversation is written as one text and tokenized whole, as the model will read it at
    inference (pieces tokenized apart would split words differently and, with SentencePiece,
    begin each piece with a space). A token is trained when the text it covers holds a
    character of a trained piece (a token of no text: when the character after it does), so a
    token that straddles the end of a prompt and the start of a response (``" Paris"`` after
    ``"Assistant:"``) is trained."""
    if template.add_bos and tokenizer.bos_id < 0:
        raise DataError(
            "template.add_bos: the tokenizer defines no BOS token; set add_bos to "
            "false or use a tokenizer with one"
        )
    pieces = [segments(parse(t), template) for t in texts]
    written = ["".join(p for p, _ in doc) for doc in pieces]
    tokens, masks = [], []
    for doc, text, (ids, spans_N2) in zip(pieces, written, tokenizer.encode_spans(written)):
        trained_C = np.repeat([int(t) for _, t in doc], [len(p) for p, _ in doc]).astype(np.int64)
        before_C = np.concatenate([[0], np.cumsum(trained_C)])  # trained characters before each
        start, end = spans_N2[:, 0], spans_N2[:, 1]
        covered = before_C[end] > before_C[start]
        empty = start == end
        at = np.minimum(start[empty], max(len(text) - 1, 0))
        covered[empty] = trained_C[at] > 0 if len(text) else False
        last_trained = bool(doc) and doc[-1][1]
        bos = [tokenizer.bos_id] if template.add_bos else []
        tokens.append(bos + list(ids) + [tokenizer.eos_id])
        masks.append(
            np.concatenate(
                [
                    np.zeros(len(bos), np.uint8),
                    covered.astype(np.uint8),
                    [int(template.train_eos and last_trained)],
                ]
            ).astype(np.uint8)
        )
    return tokens, masks
