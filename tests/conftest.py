"""Shared fixtures: a tiny real corpus, prepared once per session, and tiny run configs."""

from __future__ import annotations

import ast
import os
import signal
import sysconfig
from pathlib import Path

import pytest
import yaml

from data_pipeline.config import DataConfig, SourceConfig, TokenizerConfig
from data_pipeline.prepare import prepare
from launch.signal_latch import CATCHABLE

STDLIB_MODULES = [
    "argparse",
    "collections/__init__",
    "json/__init__",
    "pathlib",
    "textwrap",
    "shlex",
    "string",
    "heapq",
    "bisect",
    "functools",
    "typing",
    "dataclasses",
    "enum",
    "fractions",
    "calendar",
    "difflib",
]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """For pytest-xdist's ``--dist loadgroup`` (docs/testing.md): the tests of one file run on one
    worker, so a module-scoped fixture (a trained base, the export sweep's checkpoints) is built
    once; the SLURM tests are one group, so no two of their clusters (daemons, network
    namespaces, each filling both cores) run at once. Other launcher runs take free ports and
    directories of their own: one may run beside another."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = "slurm" if item.get_closest_marker("slurm") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup``, each test id a worker collected must carry its group
    (``...@group``): that is what xdist schedules by. If a pytest or xdist release stops that
    (pytest 9.2 with xdist 3.8 did: constraints.txt), every test becomes a group of its own and
    the suite silently loses what the groups are for (one build of a module's fixtures, one
    SLURM cluster at a time); stop instead."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [i for i in ids if i.rfind("@") <= i.rfind("]")]  # as xdist finds a group
    if lost:
        pytest.exit(
            f"--dist loadgroup: {len(lost)} of {len(ids)} tests lost their xdist group on "
            f"{node.gateway.id} (first: {lost[0]}): this pytest / pytest-xdist pair does not "
            "group tests; install the versions constraints.txt pins",
            returncode=4,
        )


# A shell starts a background job (`cmd &` without job control) with SIGINT and SIGQUIT ignored,
# and an ignored disposition is inherited by every child: the launcher then rightly keeps them
# ignored (as under nohup), and the tests that send Ctrl-C would see nothing. Tests start from
# Python's defaults however the suite was started.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Every test leaves os.environ and the preemption signals' handlers as it found them. An
    entry point run in-process (moe-train exports RANK/WORLD_SIZE for its rendezvous) would
    otherwise leak its rank variables into launchers that later tests start, and their ranks
    would each believe they are alone."""
    saved = dict(os.environ)
    handlers = {signum: signal.getsignal(signum) for signum in CATCHABLE}
    yield
    os.environ.clear()
    os.environ.update(saved)
    for signum, handler in handlers.items():  # an entry point run in-process holds signals;
        signal.signal(signum, handler)  # under pytest-xdist any test may run after it


def write_corpus(root: Path) -> Path:
    """Docstrings of a few standard-library modules, one text file each: small, real text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root.mkdir(parents=True, exist_ok=True)
    for name in STDLIB_MODULES:
        tree = ast.parse((stdlib / f"{name}.py").read_text(encoding="utf-8"))
        docs = [
            ast.get_docstring(n)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
        ]
        text = "\n\n".join(d for d in docs if d)
        (root / (name.replace("/", "_") + ".txt")).write_text(text, encoding="utf-8")
    return root


def tiny_data_config(root: Path) -> DataConfig:
    return DataConfig(
        dir=str(root / "data"),
        sources=[SourceConfig(name="docs", type="text", paths=[str(root / "corpus")])],
        tokenizer=TokenizerConfig(vocab_size=512, sample_sentences=50000),
        valid_fraction=0.2,
        shard_tokens=20000,
        seq_len=32,
        seed=7,
        prepare_workers=2,
    )


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("tiny")
    write_corpus(root / "corpus")
    cfg = tiny_data_config(root)
    prepare(cfg, progress=False)
    return cfg


def tiny_run_dict(data: DataConfig, out_dir: Path, **train) -> dict:
    return {
        "name": "tiny",
        "output_dir": str(out_dir),
        "model": {
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": 64,
            "moe": {"num_experts": 4, "expert_hidden": 64, "router": {"top_k": 2}},
        },
        "data": {
            "dir": data.dir,
            "seq_len": data.seq_len,
            "seed": data.seed,
            "sources": [{"name": s.name, "type": s.type, "paths": s.paths} for s in data.sources],
            "tokenizer": {
                "vocab_size": data.tokenizer.vocab_size,
                "sample_sentences": data.tokenizer.sample_sentences,
            },
            "valid_fraction": data.valid_fraction,
            "shard_tokens": data.shard_tokens,
        },
        "train": {
            "max_steps": 4,
            "micro_batch_size": 2,
            "warmup_steps": 1,
            "lr": 1e-3,
            "threads_per_rank": 1,
            **train,
        },
        "parallel": {"world_size": 2, "expert_parallel_size": 2, "zero_stage": 2},
        "logging": {"log_every": 1},
        "checkpoint": {"every_n_steps": 2},
    }


@pytest.fixture
def tiny_config_file(tiny_data, tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_run_dict(tiny_data, tmp_path / "runs")))
    return path


def rarest_token(data_dir: str) -> int:
    """The id that the prepared training split holds least often (none at all, where some id
    is unused): a batch of it is a loss spike for any model trained on that split, whatever
    the documents the split drew."""
    import numpy as np

    from data_pipeline.token_stream import TokenStream

    stream = TokenStream(data_dir, "train")
    counts = np.bincount(stream.read(0, len(stream)), minlength=stream.vocab_size)
    return int(np.argmin(counts[4:])) + 4  # not UNK, BOS, EOS, PAD
