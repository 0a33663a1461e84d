"""The commit-msg hook (.ci/commit_subject.py) and its place in .pre-commit-config.yaml."""

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "commit_subject.py"


def _check(tmp_path, message):
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)


def test_a_subject_of_72_characters_passes_and_73_fails_naming_the_length(tmp_path):
    assert _check(tmp_path, "a" * 72 + "\n\n" + "b" * 200 + "\n").returncode == 0
    failed = _check(tmp_path, "a" * 73 + "\n")
    assert failed.returncode == 1
    assert "73 characters, at most 72" in failed.stderr


def test_comment_and_blank_lines_before_the_subject_are_not_the_subject(tmp_path):
    assert _check(tmp_path, "# " + "c" * 100 + "\n\nshort subject\n").returncode == 0
    assert _check(tmp_path, "\n# note\n" + "d" * 80 + "\n").returncode == 1


def test_pre_commit_installs_it_as_a_commit_msg_hook():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    assert "commit-msg" in config["default_install_hook_types"]
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    assert hooks["commit-subject"]["stages"] == ["commit-msg"]
    assert hooks["commit-subject"]["entry"].endswith(".ci/commit_subject.py")
