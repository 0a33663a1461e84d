"""Loading lm-evaluation-harness tasks: the bundled ones (offline, data next to the YAML), a
user's folder, unknown names, a task whose data needs a network that is absent; the tokenizer a
checkpoint must bring."""

import json
import os
import subprocess
import sys

import pytest

from data_pipeline.errors import DataError
from moe.core.errors import EvaluationError
from moe.evaluation.harness import checkpoint_tokenizer
from moe.tools.task_data import multiple_choice, next_word, sentences

pytest.importorskip("lm_eval")
from moe.training.lm_harness import load_tasks


def test_bundled_tasks_load_offline_with_their_few_shot_split(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task_dict = load_tasks(["stdlib_sentence_mc", "stdlib_next_word"], num_fewshot=2)
    mc, gen = task_dict["tasks"]["stdlib_sentence_mc"], task_dict["tasks"]["stdlib_next_word"]
    assert (mc.OUTPUT_TYPE, gen.OUTPUT_TYPE) == ("multiple_choice", "generate_until")
    assert len(mc.test_docs()) == len(gen.test_docs()) == 200
    mc.build_all_requests(limit=2, rank=0, world_size=1)
    context, ending = mc.instances[0].args
    doc = mc.test_docs()[0]
    assert context.endswith(doc["context"]) and context.count("\n\n") == 2  # two shots
    assert ending == " " + doc["endings"][0] and len(mc.instances) == 8


def test_the_task_data_generator_makes_well_formed_examples():
    import random

    pool = sentences(
        [
            "Return the list of all names that match the pattern.  Ignore case when asked to.\n\n"
            "Raise ValueError if the value is not an integer at all. x = f(y).",
            "Open the file and read every line of it into one string value.",
        ]
    )
    assert pool == [
        "Return the list of all names that match the pattern.",
        "Raise ValueError if the value is not an integer at all.",
        "Open the file and read every line of it into one string value.",
    ]
    mc = multiple_choice(pool * 2, random.Random(0))
    assert all(len(d["endings"]) == 4 and 0 <= d["label"] < 4 for d in mc)
    for d, s in zip(mc, pool * 2):
        assert f"{d['context']} {d['endings'][d['label']]}" == s
    for d, s in zip(next_word(pool, random.Random(0)), pool):
        assert s.startswith(d["prompt"] + " " + d["target"])


def test_a_users_folder_of_tasks_reads_data_next_to_its_yaml(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "q.jsonl").write_text(
        json.dumps({"q": "Two", "a": [" 2", " 3"], "g": 0}) + "\n"
    )
    (tmp_path / "mine.yaml").write_text(
        "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files: data/q.jsonl\n"
        "test_split: train\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
        "doc_to_choice: '{{a}}'\ndoc_to_target: '{{g}}'\n"
    )
    monkeypatch.chdir(tmp_path.parent)  # the data is found from the YAML, not the cwd
    task = load_tasks(["mine"], [tmp_path])["tasks"]["mine"]
    assert task.test_docs()[0]["q"] == "Two"
    (tmp_path / "data" / "q.jsonl").unlink()
    with pytest.raises(EvaluationError, match=r"task mine: data file .*q.jsonl not found"):
        load_tasks(["mine"], [tmp_path])


@pytest.mark.slow
def test_unknown_names_and_absent_networks_are_named():
    """Both read the harness's whole task index (seconds): in a subprocess without network
    access to the Hugging Face Hub."""
    code = (
        "from moe.training.lm_harness import load_tasks\n"
        "from moe.core.errors import EvaluationError\n"
        "for names in (['hellaswg', 'stdlib_sentence_mc'], ['hellaswag']):\n"
        "    try:\n        load_tasks(names)\n"
        "    except EvaluationError as e:\n        print('ERROR', e)\n"
    )
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2, proc.stdout + proc.stderr[-3000:]
    unknown, offline = errors
    assert "unknown task(s): hellaswg (nearest: hellaswag" in unknown
    assert (
        "hellaswag: a data set must be downloaded from the Hugging Face Hub, which cannot "
        "be reached" in offline
    )


def test_a_checkpoint_needs_a_tokenizer_with_an_end_of_sequence_token(tmp_path):
    with pytest.raises(EvaluationError, match="no tokenizer"):
        checkpoint_tokenizer(tmp_path)
    from tokenizers import Tokenizer, models

    (tmp_path / "hf_tokenizer").mkdir()
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(
        str(tmp_path / "hf_tokenizer" / "tokenizer.json")
    )
    with pytest.raises(DataError, match="has none of the EOS tokens"):
        checkpoint_tokenizer(tmp_path)
