"""The data of the downstream tasks the project ships (moe/tasks/): built from the sentences of
the installed Python standard library's docstrings, the text the default run trains on, so they
need no download. Written once and kept in the repository (another Python version's stdlib
gives other sentences):

    python -m moe.tools.task_data moe/tasks

- ``stdlib_sentence_mc`` (multiple choice, like HellaSwag): the first half of a sentence and four
  endings, the true one and three from other sentences; scored by log-likelihood (acc, acc_norm);
- ``stdlib_next_word`` (generation): the start of a sentence; the model writes on and its first
  word must be the sentence's next word (exact match, case and punctuation ignored).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

from data_pipeline.sources import stdlib_document, stdlib_files

TEST_DOCS = 200
"""Examples in each task's test split."""
TRAIN_DOCS = 32
"""Examples in each task's train split (the few-shot examples)."""
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


def sentences(texts: list[str], min_words: int = 8, max_words: int = 20) -> list[str]:
    """Plain English sentences of the texts: one line each, of min_words to max_words words,
    without code, markup or doctest lines; each once, in order of appearance."""
    seen, out = set(), []
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            flat = " ".join(para.split())
            for s in re.split(r"(?<=[.!?])\s+", flat):
                words = s.split()
                plain = (
                    s.isascii()
                    and s[:1].isupper()
                    and s.endswith(".")
                    and not re.search(r"[>`:*=(){}\[\]_/\\|#<]", s)
                    and all(_WORD.fullmatch(w.rstrip(".,;")) for w in words)
                )
                if plain and min_words <= len(words) <= max_words and s not in seen:
                    seen.add(s)
                    out.append(s)
    return out


def multiple_choice(pool: list[str], rng: random.Random) -> list[dict]:
    """A question per sentence: its first half, and its true second half among three others."""
    halves = [
        (" ".join(s.split()[: len(s.split()) // 2]), " ".join(s.split()[len(s.split()) // 2 :]))
        for s in pool
    ]
    out = []
    for i, (context, ending) in enumerate(halves):
        others = rng.sample([h[1] for j, h in enumerate(halves) if j != i and h[1] != ending], 3)
        label = rng.randrange(4)
        endings = others[:label] + [ending] + others[label:]
        out.append({"context": context, "endings": endings, "label": label})
    return out


def next_word(pool: list[str], rng: random.Random) -> list[dict]:
    """A prompt per sentence: its first 4 words or more, and the word that follows."""
    out = []
    for s in pool:
        words = s.split()
        cut = rng.randrange(4, len(words))
        out.append({"prompt": " ".join(words[:cut]), "target": words[cut].rstrip(".,;")})
    return out


def build(out_dir: Path, seed: int = 0) -> dict[str, int]:
    """Write each task's train and test JSONL files into ``out_dir``; returns their counts."""
    pool = sentences([stdlib_document(p) for p in stdlib_files()])
    rng = random.Random(seed)
    rng.shuffle(pool)
    need = 2 * (TEST_DOCS + TRAIN_DOCS)
    if len(pool) < need:
        raise SystemExit(f"only {len(pool)} usable sentences in the stdlib; {need} are needed")
    counts = {}
    for name, make, part in (
        ("stdlib_sentence_mc", multiple_choice, pool[: need // 2]),
        ("stdlib_next_word", next_word, pool[need // 2 : need]),
    ):
        docs = make(part, rng)
        for split, rows in (("train", docs[:TRAIN_DOCS]), ("test", docs[TRAIN_DOCS:])):
            path = out_dir / f"{name}.{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
            counts[path.name] = len(rows)
    return counts


if __name__ == "__main__":
    for name, n in build(Path(sys.argv[1] if len(sys.argv) > 1 else "moe/tasks")).items():
        print(f"{name}: {n} examples")
