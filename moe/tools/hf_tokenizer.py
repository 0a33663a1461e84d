"""The tokenizer of a Hugging Face export: a ``transformers`` fast tokenizer that gives the same
ids as the run's own tokenizer, built from its SentencePiece model (pieces, merges or scores,
normalization and whitespace handling) or loaded from an imported model's ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path

from moe.core.errors import CheckpointError


def hf_tokenizer(model_file: Path):
    """A ``transformers`` fast tokenizer that reproduces the SentencePiece model's ids: its
    pieces and merges, its NFKC character map, whitespace collapsing and dummy prefix."""
    import sentencepiece as spm
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    if model_file.read_bytes().lstrip()[:1] == b"{":  # a tokenizer.json (an imported model's)
        return _json_tokenizer(model_file)
    tok = _sentencepiece_tokenizer(model_file)
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    specials = {
        name: sp.id_to_piece(i)
        for name, i in (
            ("unk_token", sp.unk_id()),
            ("bos_token", sp.bos_id()),
            ("eos_token", sp.eos_id()),
            ("pad_token", sp.pad_id()),
        )
        if i >= 0
    }
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in specials.values()]
    )
    ids = {
        f"{name[:-6]}_token_id": sp.piece_to_id(piece)
        for name, piece in specials.items()
        if name != "unk_token"
    }
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials), ids


def _json_tokenizer(model_file: Path):
    """An imported model's ``tokenizer.json`` as it is, with the special tokens our reader finds."""
    from transformers import PreTrainedTokenizerFast

    from data_pipeline.tokenizer import Tokenizer as OurTokenizer

    ours = OurTokenizer(model_file)
    ids = {
        f"{k}_token_id": i
        for k, i in (("bos", ours.bos_id), ("eos", ours.eos_id), ("pad", ours.pad_id))
        if i >= 0
    }
    specials = {f"{k[:-9]}_token": ours.id_to_piece(i) for k, i in ids.items()}
    return PreTrainedTokenizerFast(tokenizer_file=str(model_file), **specials), ids


def _sentencepiece_tokenizer(model_file: Path):
    """The ``tokenizers`` model, normalizer, pre-tokenizer and decoder of a SentencePiece model
    (BPE or unigram), without its special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE, Unigram
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    extractor = SentencePieceExtractor(str(model_file))
    proto = extractor.proto
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    if trainer.model_type == 2:
        kw = extractor.extract(BPE)
        tok = Tokenizer(
            BPE(
                kw["vocab"],
                kw["merges"],
                unk_token=trainer.unk_piece,
                fuse_unk=True,
                byte_fallback=trainer.byte_fallback,
            )
        )
    elif trainer.model_type == 1:
        tok = Tokenizer(
            Unigram(
                [(p.piece, p.score) for p in proto.pieces],
                unk_id=trainer.unk_id,
                byte_fallback=trainer.byte_fallback,
            )
        )
    else:
        raise CheckpointError(f"{model_file}: only BPE and unigram SentencePiece models export")
    steps = (
        [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    )
    if spec.remove_extra_whitespaces:
        steps += [
            normalizers.Strip(left=True, right=True),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if spec.add_dummy_prefix:
        # SentencePiece adds the dummy "▁" even when the text already starts with whitespace;
        # the Metaspace pre-tokenizer's own prepend skips it then, so prepend in the normalizer.
        steps.append(normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    prepend = "always" if spec.add_dummy_prefix else "never"
    # SentencePiece never merges pieces across a whitespace boundary when split_by_whitespace is
    # set (its default): each "▁" starts a new word. Without the split, BPE merges such as
    # "▁▁" (indentation, with identity normalization) would join words and change the ids.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="never", split=trainer.split_by_whitespace
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Metaspace(replacement="▁", prepend_scheme=prepend, split=False),
            decoders.ByteFallback(),
            decoders.Fuse(),
        ]
    )
    return tok
