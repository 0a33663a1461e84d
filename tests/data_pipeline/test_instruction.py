"""Instruction data: conversations written with a template, a loss mask in the shards that covers
exactly the trained roles' tokens, packing and resume that keep it, evaluation that averages the
loss over the trained tokens only, and bad records refused by file and line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml

from data_pipeline.config import DataConfig, RoleTemplate, SourceConfig, TemplateConfig
from data_pipeline.prepare import config_hash, prepare
from data_pipeline.prepared import PreparedData
from data_pipeline.reader import IGNORE_INDEX, PackedReader
from data_pipeline.shards import read_manifest
from data_pipeline.token_stream import TokenStream, Window, token_windows
from data_pipeline.tokenizer import Tokenizer
from data_pipeline.verify import verify
from launch import prepare as prepare_cli
from moe.evaluation.evaluate import evaluate_loss, evaluate_perplexity
from moe.model.transformer import ModelConfig, ModelOutput, MoETransformer
from tests.conftest import tiny_run_dict
from tests.data_pipeline.conftest import prepare_in_parts
from tests.helpers.reader_reference import ReferenceRows

KNOWN = {"prompt": "What is the capital of France?", "response": "Paris is the capital of France."}


def conversations(corpus: Path, prompt_words: int = 1) -> list[dict]:
    """Instruction records made from the corpus's paragraphs: each asks for a paragraph by its
    first words (``prompt_words`` times repeated: a longer or shorter prompt, same responses);
    every third is a chat with a system message and two exchanges; KNOWN first."""
    out = [KNOWN]
    paras = [
        p.strip()
        for path in sorted(corpus.iterdir())
        for p in path.read_text(encoding="utf-8").split("\n\n")
        if p.strip()
    ][:240]
    for i, para in enumerate(paras):
        ask = " ".join(["Continue:"] * prompt_words + para.split()[:3])
        if i % 3:
            out.append({"prompt": ask, "response": para})
        else:
            out.append(
                {
                    "messages": [
                        {"role": "system", "content": "You complete docstrings."},
                        {"role": "user", "content": ask},
                        {"role": "assistant", "content": para[:40] or para},
                        {"role": "user", "content": "And then?" * prompt_words},
                        {"role": "assistant", "content": para},
                    ]
                }
            )
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def instruction_config(
    tiny_data: DataConfig, root: Path, template: TemplateConfig | None = None, **kw
) -> DataConfig:
    source = SourceConfig(
        name="chat",
        type="instruction",
        paths=[str(root / "chat.jsonl")],
        template=template or TemplateConfig(),
    )
    tokenizer = dataclasses.replace(
        tiny_data.tokenizer, model_file=str(PreparedData(tiny_data.dir).tokenizer_file())
    )
    return dataclasses.replace(
        tiny_data,
        dir=str(root / "data"),
        sources=[source],
        tokenizer=tokenizer,
        shard_tokens=4096,
        seq_len=16,
        prepare_workers=1,
        **kw,
    )


@pytest.fixture(scope="module")
def corpus(tiny_data) -> Path:
    return Path(tiny_data.sources[0].paths[0])


@pytest.fixture(scope="module")
def instruction_data(tiny_data, corpus, tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("instruction")
    write_jsonl(root / "chat.jsonl", conversations(corpus))
    cfg = instruction_config(tiny_data, root)
    prepare(cfg, progress=False)
    return cfg


def documents(data_dir) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, loss mask) of every document of every shard, read from the Arrow files."""
    manifest = read_manifest(data_dir)
    out = []
    for split in manifest.splits.values():
        for info in split.shards:
            table = pa.ipc.open_file(str(Path(data_dir) / info.file)).read_all()
            for tokens, mask in zip(
                table.column("tokens").to_pylist(), table.column("loss_mask").to_pylist()
            ):
                out.append((np.array(tokens), np.array(mask)))
    return out


def test_the_mask_covers_exactly_the_response_tokens(instruction_data, corpus):
    tok = Tokenizer(PreparedData(instruction_data.dir).tokenizer_file())
    manifest = read_manifest(instruction_data.dir)
    assert manifest.loss_mask and manifest.sources[0]["template_sha256"]
    docs = documents(instruction_data.dir)
    assert len(docs) == len(conversations(corpus))
    ((tokens, mask),) = [(t, m) for t, m in docs if "capital of France?" in tok.decode(t.tolist())]
    # The conversation as the template writes it, tokenized whole, then EOS.
    text = f"User: {KNOWN['prompt']}\n\nAssistant: {KNOWN['response']}\n\n"
    assert tokens.tolist() == tok.encode(text) + [tok.eos_id]
    # Trained: the response with the assistant's suffix, then the closing EOS; nothing else.
    # (The space after "Assistant:" goes with the response's first token.)
    n = int(mask.sum())
    assert mask.tolist() == [0] * (len(mask) - n) + [1] * n
    assert tokens[-1] == tok.eos_id
    assert tok.decode(tokens[mask == 1][:-1].tolist()) == KNOWN["response"] + "\n\n"
    assert tok.decode(tokens[mask == 0].tolist()) == "User: " + KNOWN["prompt"] + "\n\nAssistant:"
    # A chat: both assistant turns trained, the system and user turns not.
    chats = [(t, m) for t, m in docs if "You complete docstrings." in tok.decode(t.tolist())]
    assert chats
    for tokens, mask in chats:
        prompt = tok.decode(tokens[mask == 0].tolist())
        assert prompt.startswith("System: You complete docstrings.\n\nUser: Continue:")
        assert prompt.count("Assistant:") == 2 and "And then?" in prompt
        assert "And then?" not in tok.decode(tokens[mask == 1].tolist())


def test_the_template_decides_prefixes_bos_and_the_trained_roles(tiny_data, tmp_path):
    write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": "Say hi."},
                    {"role": "assistant", "content": "Hi there."},
                    {"role": "user", "content": "Thanks."},
                ]
            }
        ]
        * 3
        + [KNOWN] * 40,
    )
    template = TemplateConfig(
        user=RoleTemplate("Q:\n", "\n"),
        assistant=RoleTemplate("A:\n", "\n"),
        add_bos=True,
        train_roles=["user", "assistant"],
    )
    cfg = instruction_config(tiny_data, tmp_path, template, valid_fraction=0.5)
    prepare(cfg, progress=False)
    tok = Tokenizer(PreparedData(cfg.dir).tokenizer_file())
    for tokens, mask in documents(cfg.dir):
        assert tokens[0] == tok.bos_id and mask[0] == 0
        trained = tok.decode(tokens[mask == 1].tolist())
        assert tok.decode(tokens[mask == 0].tolist()).replace("\n", "|") in ("Q:|A:|Q:|", "Q:|A:|")
        if "Thanks" in trained:  # the last message is the user's, trained: so is the EOS
            assert trained == "Say hi.\nHi there.\nThanks.\n" and mask[-1] == 1
        else:
            assert trained == KNOWN["prompt"] + "\n" + KNOWN["response"] + "\n"
    # A new template is a new preparation (the manifest and config hash say so).
    other = dataclasses.replace(
        cfg,
        sources=[
            dataclasses.replace(
                cfg.sources[0], template=dataclasses.replace(template, add_bos=False)
            )
        ],
    )
    assert config_hash(other) != config_hash(cfg)
    # Sources other than instruction keep the hash they had before templates existed (this
    # value was computed before).
    before = DataConfig(sources=[SourceConfig(name="a", type="jsonl", paths=["x.jsonl"])])
    assert config_hash(before) == "1d06d24669c28435"


def test_masked_data_verifies_and_its_stream_reads_the_mask(instruction_data, tiny_data):
    assert "fingerprint" in verify(instruction_data.dir, progress=False)
    stream = TokenStream(instruction_data.dir, "train")
    mask = stream.read_mask(0, len(stream))
    assert 0 < mask.mean() < 1
    # Data without a mask has no mask to read (all tokens are targets).
    tiny = TokenStream(tiny_data.dir, "train")
    assert tiny.read_mask(0, 10) is None


def test_packing_keeps_each_documents_mask(instruction_data):
    reader = PackedReader(
        instruction_data.dir, instruction_data.seq_len, 3, micro_batch=4, document_ids=True
    )
    reference = ReferenceRows(reader)
    stream = reader.streams[0]
    masks = np.concatenate([stream.masks[i] for i in stream._epoch(0)[0]])
    crossing = mixed = 0
    for step in range(stream.num_samples // 4):
        (batch,) = reader.next_step(1)
        for r in range(4):
            g = step * 4 + r
            tokens = reference(g).astype(np.int64)
            begin = int(stream._epoch(0)[2](np.array([g]))[0]) * stream.window
            want = np.where(masks[begin + 1 : begin + stream.window] == 1, tokens[1:], IGNORE_INDEX)
            assert batch.tokens_BS[r].tolist() == tokens.tolist()
            assert batch.targets_BS[r].tolist() == want.tolist(), g
            crossing += int(batch.doc_ids_BS[r].max()) > 0
            mixed += 0 < int((batch.targets_BS[r] == IGNORE_INDEX).sum()) < len(want)
    assert crossing > 10 and mixed > 10  # rows that hold several documents, prompt and response


def _steps(reader, n):
    return [
        (b.tokens_BS.clone(), b.targets_BS.clone()) for _ in range(n) for b in reader.next_step(2)
    ]


@pytest.mark.parametrize("workers", [0, 1])
def test_resume_mid_epoch_on_masked_data_is_exact(instruction_data, workers):
    def reader():
        return PackedReader(
            instruction_data.dir, instruction_data.seq_len, 5, micro_batch=3, loader_workers=workers
        )

    whole = _steps(reader(), 6)
    first = reader()
    _steps(first, 2)
    resumed = reader()
    resumed.load_state_dict(first.state_dict())
    rest = _steps(resumed, 4)
    assert len(rest) == len(whole[4:]) == 8
    for (t, y), (t2, y2) in zip(rest, whole[4:]):
        assert torch.equal(t, t2) and torch.equal(y, y2)
    assert any((y == IGNORE_INDEX).any() for _, y in rest)


class Unigram(torch.nn.Module):
    """Logits that do not depend on the inputs: the loss is a function of the targets alone."""

    def __init__(self, vocab: int):
        super().__init__()
        self.logits_V = torch.nn.Parameter(
            torch.randn(vocab, generator=torch.Generator().manual_seed(3))
        )

    def forward(self, input_ids_BS):
        return ModelOutput(
            self.logits_V.expand(*input_ids_BS.shape, -1), None, None, self.logits_V.new_zeros(())
        )


def _loss_over_both_splits(model, data_dir, seq_len) -> tuple[float, int]:
    total = count = 0
    for split in ("train", "valid"):
        r = evaluate_loss(model, token_windows(TokenStream(data_dir, split), seq_len), 7)
        total, count = total + r["loss"] * r["tokens"], count + r["tokens"]
    return total / count, count


def test_changing_the_targets_of_prompt_tokens_does_not_change_the_instruction_loss(
    tiny_data, corpus, tmp_path
):
    """The same responses behind prompts three times as long: every prompt token differs, and a
    model whose predictions do not depend on its inputs has the same loss on both."""
    losses = []
    for words in (1, 3):
        root = tmp_path / f"p{words}"
        write_jsonl(root / "chat.jsonl", conversations(corpus, words))
        cfg = instruction_config(tiny_data, root)
        prepare(cfg, progress=False)
        losses.append(_loss_over_both_splits(Unigram(512), cfg.dir, cfg.seq_len))
    (a, n_a), (b, n_b) = losses
    assert n_a == n_b
    assert math.isclose(a, b, rel_tol=1e-6), (a, b)
    # Counted over every target, the prompts would change it.
    plain = [
        evaluate_loss(
            Unigram(512),
            [
                Window(w, w[1:])
                for w, _ in token_windows(TokenStream(tmp_path / f"p{k}" / "data", "train"), 16)
            ],
            7,
        )
        for k in (1, 3)
    ]
    assert plain[1]["tokens"] > plain[0]["tokens"]
    assert not math.isclose(plain[0]["loss"], plain[1]["loss"], rel_tol=1e-6)


def test_evaluation_reports_the_loss_of_the_trained_tokens(instruction_data):
    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=4, max_seq_len=32)
    ).eval()
    r = evaluate_perplexity(model, instruction_data.dir, 16, batch_size=5)
    stream = TokenStream(instruction_data.dir, "valid")
    tokens, mask = stream.read(0, len(stream)), stream.read_mask(0, len(stream))
    total, count, start = 0.0, 0, 0
    with torch.no_grad():  # by hand: window by window, summing the trained positions only
        while start + 1 < len(tokens):
            w = torch.from_numpy(tokens[start : start + 17])
            logp = torch.log_softmax(model(w[None, :-1]).logits[0].double(), -1)
            for i in range(len(w) - 1):
                if mask[start + i + 1]:
                    total -= float(logp[i, w[i + 1]])
                    count += 1
            start += len(w) - 1
    assert r["tokens"] == count == int(mask[1:].sum()) < r["positions"] == len(tokens) - 1
    assert math.isclose(r["loss"], total / count, rel_tol=1e-5)
    assert math.isclose(r["perplexity"], math.exp(total / count), rel_tol=1e-4)


def test_a_micro_batch_of_prompt_tokens_only_has_a_zero_loss(instruction_data):
    model = MoETransformer(
        ModelConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=4, max_seq_len=32)
    )
    x = torch.randint(0, 512, (2, 8))
    out = model(x, torch.full((2, 8), IGNORE_INDEX))
    assert out.lm_loss.item() == 0.0
    out.loss.backward()  # finite gradients, not NaN
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- bad input ---

BAD = [
    (
        {"question": "Why?", "answer": "Because."},
        "has neither 'prompt' and 'response' nor 'messages'",
    ),
    (
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]},
        "messages[1] has the unknown role 'bot'; roles are system, user, assistant",
    ),
    ({"prompt": "Why?", "response": "  "}, "the response is empty"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "no message of a trained role"),
    ({"prompt": "Why?", "response": 3}, "field 'response' is int, expected a string"),
]


@pytest.mark.parametrize("record,needle", BAD, ids=["fields", "role", "empty", "untrained", "type"])
def test_bad_records_are_refused_by_file_and_line(tiny_data, tmp_path, capsys, record, needle):
    path = write_jsonl(tmp_path / "chat.jsonl", [KNOWN] * 3 + [record] + [KNOWN])
    raw = tiny_run_dict(tiny_data, tmp_path / "runs")
    raw["data"].update(
        dir=str(tmp_path / "out"),
        sources=[{"name": "chat", "type": "instruction", "paths": [str(path)]}],
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit) as exc:
        prepare_cli.main([str(config), "--quiet"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert f"{path}: line 4" in err and needle in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_template_options_are_checked(tiny_data, tmp_path):
    from moe.core.config_schema import from_dict
    from moe.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        from_dict(
            DataConfig,
            {
                "sources": [
                    {"type": "instruction", "paths": ["a.jsonl"], "template": {"train_roles": []}},
                    {
                        "name": "b",
                        "type": "jsonl",
                        "paths": ["b.jsonl"],
                        "template": {"add_bos": True},
                    },
                ]
            },
        )
    assert "sources[0].template.train_roles: name at least one role" in str(e.value)
    assert "sources[1].template: only 'instruction' sources have a template" in str(e.value)
    with pytest.raises(ConfigError, match="template.user.prefx"):
        from_dict(
            DataConfig,
            {
                "sources": [
                    {"type": "instruction", "paths": ["a"], "template": {"user": {"prefx": "Q"}}}
                ]
            },
        )
    with pytest.raises(ConfigError, match="train_roles"):
        from_dict(
            DataConfig,
            {
                "sources": [
                    {"type": "instruction", "paths": ["a"], "template": {"train_roles": ["bot"]}}
                ]
            },
        )


def test_parts_and_deduplication_keep_the_masks(tiny_data, corpus, tmp_path):
    """A --part/--merge preparation writes the shards one machine writes (the masks travel in
    the parts' spill files), and ``dedup: exact`` drops a conversation's copies with their
    masks."""
    records = conversations(corpus)[:60]
    write_jsonl(tmp_path / "chat.jsonl", records + records[::2])
    one = instruction_config(tiny_data, tmp_path, dedup="exact")
    prepare(one, progress=False)
    many = dataclasses.replace(one, dir=str(tmp_path / "many"))
    prepare_in_parts(many, 2)
    assert read_manifest(many.dir).fingerprint == read_manifest(one.dir).fingerprint
    unique = len({json.dumps(r, sort_keys=True) for r in records})
    assert read_manifest(one.dir).sources[0]["duplicates_dropped"] == 90 - unique >= 30
    tok = Tokenizer(PreparedData(one.dir).tokenizer_file())
    docs = documents(one.dir)
    assert len(docs) == unique
    for tokens, mask in docs:
        assert tokens[-1] == tok.eos_id and mask[-1] == 1 and mask[0] == 0
        assert tok.decode(tokens[mask == 1][:-1].tolist()).endswith("\n\n")


def test_a_tokenizer_json_gives_the_same_mask(tmp_path):
    """The offsets of a Hugging Face tokenizer.json (byte-level BPE) decide the mask as
    SentencePiece's do; a template that asks for BOS needs a tokenizer that has one."""
    from data_pipeline.errors import DataError
    from data_pipeline.instruction import canonical, encode, render
    from tests.data_pipeline.test_tokenizer_json import write_json

    write_json(tmp_path / "tokenizer.json")
    tok = Tokenizer(tmp_path / "tokenizer.json")
    text = canonical([("user", "pack my box"), ("assistant", "the quick brown fox")])
    (ids,), (mask,) = encode([text], TemplateConfig(), tok)
    assert ids == tok.encode(render(text, TemplateConfig())) + [tok.eos_id]
    n = int(mask.sum())
    assert mask.tolist() == [0] * (len(mask) - n) + [1] * n
    assert tok.decode(ids[len(ids) - n : -1]) == " the quick brown fox\n\n"
    assert tok.decode(ids[: len(ids) - n]) == "User: pack my box\n\nAssistant:"
    write_json(tmp_path / "no_bos.json", specials=("</s>", "<pad>"))
    with pytest.raises(DataError, match="template.add_bos: the tokenizer defines no BOS"):
        encode([text], TemplateConfig(add_bos=True), Tokenizer(tmp_path / "no_bos.json"))


def test_an_instruction_source_beside_plain_text_trains_every_text_token(
    tiny_data, corpus, tmp_path
):
    """With an instruction source, every shard has the mask column; a text source's are all
    ones, and the mixture reads both."""
    write_jsonl(tmp_path / "chat.jsonl", conversations(corpus)[:80])
    cfg = instruction_config(tiny_data, tmp_path)
    cfg = dataclasses.replace(cfg, sources=[*cfg.sources, tiny_data.sources[0]])
    prepare(cfg, progress=False)
    manifest = read_manifest(cfg.dir)
    assert manifest.loss_mask and "template" not in manifest.sources[1]
    docs = TokenStream(cfg.dir, "train", "docs")
    assert docs.read_mask(0, len(docs)).all()
    chat = TokenStream(cfg.dir, "train", "chat")
    assert not chat.read_mask(0, len(chat)).all()
    reader = PackedReader(cfg.dir, 16, 1, micro_batch=8)
    batches = [b for _ in range(20) for b in reader.next_step(1)]
    assert all(b.targets_BS is not None for b in batches)
    assert any((b.targets_BS == IGNORE_INDEX).any() for b in batches)


def test_verify_refuses_a_mask_value_other_than_0_or_1(instruction_data, tmp_path):
    import shutil

    from data_pipeline.errors import DataError
    from data_pipeline.shards import write_manifest, write_shard

    copy = tmp_path / "data"
    shutil.copytree(instruction_data.dir, copy)
    manifest = read_manifest(copy)
    info = manifest.splits["train"].shards[0]
    table = pa.ipc.open_file(str(copy / info.file)).read_all()
    lengths = [len(t) for t in table.column("tokens").to_pylist()]
    mask = np.concatenate([np.array(m, np.uint8) for m in table.column("loss_mask").to_pylist()])
    mask[5] = 2
    tokens = np.concatenate([np.array(t) for t in table.column("tokens").to_pylist()])
    new = write_shard(copy / info.file, info.source, tokens, np.array(lengths), 512, mask)
    manifest.splits["train"].shards[0] = dataclasses.replace(new, file=info.file)
    write_manifest(copy, manifest)
    with pytest.raises(DataError, match=f"{info.file}: loss mask value 2"):
        verify(copy, progress=False)
