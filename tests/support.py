"""Helpers several test modules share: tiny runs, their corpora and fine-tuning data, and
checks of what a run wrote. (Fixtures shared by every test are in conftest.py.)"""

import hashlib
import json
import socket

import numpy as np
import pytest

from configs.finetune import glue as glue_config
from maelm_jax.infra import errors
from maelm_jax.pretrain import train as pretrain_train

from tiny_config import tiny_config


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for a coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: str, chars: int = 3000) -> str:
    """The end of a process's log for an assertion message, without the list of extension
    modules Python prints after a fatal error's stacks (it alone fills 3,000 characters)."""
    kept = [line for line in log.splitlines() if not line.startswith("Extension modules:")]
    return "\n".join(kept)[-chars:]


# ---------------------------------------------------------------- pretraining

def snapshot(path):
    """Every file under path with its content hash (None if path does not exist)."""
    if not path.exists():
        return None
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def train_metrics(workdir, split="train"):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == split}



def plain_documents(n=200, word="stones"):
    return "\n\n".join(f"document {i} is a sentence of plain words about rivers and {word}. "
                       * 4 for i in range(n))


def plain_corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    if not path.exists():  # rewriting would change its fingerprint and re-prepare the data
        path.write_text(plain_documents())
    return path


def tiny_pretraining(tmp_path, tok, **train):
    c = tiny_config("maelm", tok.model_path)
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = str(plain_corpus(tmp_path))
    c.train.num_steps = 4
    for key, value in train.items():
        c.train[key] = value
    return c


def preempt_at(monkeypatch, config, workdir, step: int) -> None:
    """Runs pretraining of `config` in `workdir` until a stop is requested after `step`
    (it saves that step and raises Preempted), then lets later runs go on undisturbed."""
    from maelm_jax.training import engine, preemption

    real = engine.Loop.stop_requested
    monkeypatch.setattr(engine.Loop, "stop_requested", lambda self, at: at == step)
    with pytest.raises(preemption.Preempted, match=f"at step {step}"):
        pretrain_train.train_and_evaluate(config, str(workdir))
    monkeypatch.setattr(engine.Loop, "stop_requested", real)


def expect_user_error(config, workdir, match):
    before = snapshot(workdir)
    with pytest.raises(errors.UserError, match=match) as info:
        pretrain_train.train_and_evaluate(config, str(workdir))
    assert "\n" not in str(info.value)
    assert snapshot(workdir) == before, "the workdir changed"



def made_up_documents(n: int, seed: int = 0) -> list[str]:
    """Paragraphs of made-up words: enough distinct text for a 512-piece tokenizer."""
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "da", "pe", "qui", "zen"]
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(400)]
    return [" ".join(rng.choice(words, size=int(rng.integers(40, 120)))) + "."
            for _ in range(n)]



# ---------------------------------------------------------------- fine-tuning

WORDS = {1: ["good", "great", "fine", "lovely", "fun"], 0: ["bad", "awful", "poor", "dull"]}

# A tiny encoder on local SST-2-style files; applied in-process or as --config flags.
FINETUNE_TINY = {
    "model.num_layers": 1, "model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64,
    "model.rel_pos_buckets": 8, "model.rel_pos_max_distance": 16, "model.max_positions": 32,
    "data.max_seq_len": 32, "data.buckets": (32,), "mesh.shape": (1, 1, 1),
    "fast_compile": True, "predict_test": False, "train.learning_rate": 1e-3,
    "train.batch_size": 8, "train.eval_batch_size": 16,
}


def write_sst2(directory, n, seed):
    rng = np.random.default_rng(seed)
    rows = ["sentence\tlabel"]
    for label in rng.integers(2, size=n):
        rows.append(f"the film was {rng.choice(WORDS[int(label)])} and long\t{label}")
    (directory / ("train.tsv" if seed == 0 else "dev.tsv")).write_text("\n".join(rows) + "\n")


def tiny_finetuning(settings, **changes):
    c = glue_config.get_config("sst2")
    for name, value in {**settings, **changes}.items():
        *sections, field = name.split(".")
        node = c
        for section in sections:
            node = node[section]
        node[field] = value
    return c


def finetune_flags(settings, **changes):
    return [f"--config.{name}={value}" for name, value in {**settings, **changes}.items()]


def assert_close(got, want, where="", atol=1e-6):
    """Equal structure and text, numbers within atol."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}", atol)
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=False)):
            assert_close(a, b, f"{where}[{i}]", atol)
    elif isinstance(want, (float, np.ndarray)):
        assert np.allclose(got, want, rtol=0, atol=atol), where
    else:
        assert got == want, where


POSITIVE = ["good", "great", "fine", "lovely", "fun"]
NEGATIVE = ["bad", "awful", "poor", "dull", "sad"]


def sst2_like(directory, n, seed):
    """An SST-2-format file whose label is the sentiment word's."""
    rng = np.random.default_rng(seed)
    rows = ["sentence\tlabel"]
    for _ in range(n):
        label = int(rng.integers(2))
        word = rng.choice(POSITIVE if label else NEGATIVE)
        rows.append(f"the film was {word} and long\t{label}")
    return "\n".join(rows) + "\n"



class Interrupt(Exception):
    """What interrupt_batches raises in place of a step's batch."""


def interrupt_batches(monkeypatch, starts, interrupt_at=None, how=None):
    """Spies on finetune.train.train_batches (a run's batches, and a seed group's through
    it): records each caller's start step in `starts`; `how` ("raise" or "sigterm")
    interrupts the first caller that asks for step `interrupt_at`'s batch: Interrupt, or a
    SIGTERM to this process, which the loop's StopRequest turns into a checkpoint."""
    import os
    import signal

    from maelm_jax.finetune import train

    real, pending = train.train_batches, [how]

    def batches(*args):
        starts.append(args[-1])
        for step, item in enumerate(real(*args), start=args[-1] + 1):
            if step == interrupt_at and pending == ["raise"]:
                pending.clear()
                raise Interrupt(step)
            if step == interrupt_at and pending == ["sigterm"]:
                pending.clear()
                os.kill(os.getpid(), signal.SIGTERM)
            yield item

    monkeypatch.setattr(train, "train_batches", batches)
