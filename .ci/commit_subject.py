"""The commit-msg check of .pre-commit-config.yaml: a commit's subject (its first line) is at
most 72 characters, so that it reads whole in `git log --oneline`, in shortlogs and in mail.

    python3 .ci/commit_subject.py MESSAGE_FILE

Exit 1 with the subject's length and the limit when it is longer; comment lines (``#``) that git
strips are ignored.
"""

from __future__ import annotations

import sys
from pathlib import Path

LIMIT = 72


def subject(message: str) -> str:
    """The first line git keeps: not empty and not a comment."""
    for line in message.splitlines():
        if line.strip() and not line.startswith("#"):
            return line.rstrip()
    return ""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: commit_subject.py MESSAGE_FILE", file=sys.stderr)
        return 2
    first = subject(Path(argv[0]).read_text(encoding="utf-8"))
    if len(first) > LIMIT:
        print(
            f"commit subject is {len(first)} characters, at most {LIMIT}: {first!r}; "
            "put the detail in the body, after a blank line",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
