"""A Hugging Face tokenizer.json as the data tokenizer (data.tokenizer.model_file): the ids the
tokenizers library gives, its special tokens found by name, its hash, and refusals."""

import hashlib

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from data_pipeline.errors import DataError
from data_pipeline.tokenizer import Tokenizer

TEXT = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen jugs"] * 20


def write_json(path, specials=("<s>", "</s>", "<pad>", "<unk>")):
    tok = HFTokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        TEXT,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=list(specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(path))
    return HFTokenizer.from_file(str(path))


def test_a_tokenizer_json_encodes_decodes_and_names_its_special_ids(tmp_path):
    hf = write_json(tmp_path / "tokenizer.json")
    tok = Tokenizer(tmp_path / "tokenizer.json")
    text = "the lazy fox, with jugs!"
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids
    assert tok.encode_batch([text, "box"]) == [tok.encode(text), tok.encode("box")]
    assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.id_to_piece(1) == "</s>"
    assert tok.vocab_size == hf.get_vocab_size()
    assert tok.sha256 == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.describe()["eos_id"] == 1


def test_a_tokenizer_json_without_eos_or_a_foreign_file_is_refused(tmp_path):
    write_json(tmp_path / "tokenizer.json", specials=("<pad>",))
    with pytest.raises(DataError, match="none of the EOS tokens"):
        Tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match="neither a SentencePiece model nor a valid tokenizer.json"):
        Tokenizer(tmp_path / "bad.json")
