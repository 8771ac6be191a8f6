"""The fine-tuning task protocol (maelm_jax/finetune/tasks): GLUE and SQuAD are two
registered kinds, and a new kind is one class plus one `register` call. The toy kind below
(is a keyword in the text?, read from a JSON file, with its own config.keyword.* fields)
fine-tunes end to end through train.run, resumes after a SIGTERM exactly, reads back for the
analysis, and is refused with one line when its own fields are bad.
"""

import json
import os
import signal

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from maelm_jax import run_configs
from maelm_jax.analysis import inputs
from maelm_jax.config import schema
from maelm_jax.export import run as export_run
from maelm_jax.export.config import ExportError
from maelm_jax.finetune import config as finetune_config
from maelm_jax.finetune import data, heads, tasks, train
from maelm_jax.training import preemption

from support import FINETUNE_TINY

pytestmark = pytest.mark.tier("integration")


class KeywordTask(tasks.Task):
    """Whether a text holds config.keyword.word: texts from config.keyword.path, a JSON
    file {"train": [text, ...], "dev": [text, ...]}; accuracy on dev."""

    kind = "keyword"
    name = "Keyword"
    primary_metric = "accuracy"

    @classmethod
    def task_names(cls):
        return ("keyword",)

    @classmethod
    def add_defaults(cls, c):
        c.keyword = ml_collections.ConfigDict({"path": "", "word": "good"})

    @classmethod
    def fields(cls):
        return {"keyword.path": schema.path("a JSON file of texts"),
                "keyword.word": schema.text("a word")}

    @classmethod
    def validate(cls, c):
        tasks.base.require(len(c.keyword.word.split()) == 1, "keyword.word", "one word",
                           c.keyword.word)
        tasks.base.require(bool(c.keyword.path), "keyword.path", "a JSON file of texts", "")

    def __init__(self, config, tok, max_len):
        texts = json.loads(open(config.keyword.path).read())

        def split(rows):
            labels = np.asarray([int(config.keyword.word in t.split()) for t in rows], np.int32)
            return tasks.Split(data.encode_texts(tok, [rows], max_len), {"labels": labels})

        self.train, self.eval = split(texts["train"]), {"dev": split(texts["dev"])}

    def model(self, encoder_cfg):
        return heads.SequenceClassifier(encoder_cfg, 2, 0.0)

    def loss_sums(self, outputs, batch):
        return heads.classification_loss_sums(outputs, batch["labels"], batch["weights"])

    def eval_outputs(self, outputs):
        return {"prediction": jnp.argmax(outputs, axis=-1)}

    def score(self, run_eval):
        dev = self.eval["dev"]
        predicted = data.scatter_rows([(rows, out["prediction"]) for rows, out
                                       in run_eval(dev.sequences, dev.targets)], len(dev))
        return {"accuracy": 100.0 * float(np.mean(predicted == dev.targets["labels"]))}


@pytest.fixture
def keyword_kind():
    tasks.register(KeywordTask)
    yield KeywordTask
    tasks.unregister(KeywordTask.kind)


def _texts(n, seed):
    rng = np.random.default_rng(seed)
    words = ["good", "film", "long", "dull", "plot", "cast"]
    return [" ".join(rng.choice(words, size=4)) for _ in range(n)]


@pytest.fixture
def keyword_config(keyword_kind, tmp_path, tiny_tokenizer):
    """48 train texts = 6 steps of 8 per epoch, two epochs, evaluated after each."""
    path = tmp_path / "keyword.json"
    path.write_text(json.dumps({"train": _texts(48, 0), "dev": _texts(16, 1)}))
    c = finetune_config.finetune_defaults()
    for name, value in {**FINETUNE_TINY, "task": "keyword", "keyword.path": str(path),
                        "tokenizer_path": tiny_tokenizer.model_path, "train.num_epochs": 2,
                        "train.checkpoint_every": 0}.items():
        *sections, field = name.split(".")
        node = c
        for section in sections:
            node = node[section]
        node[field] = value
    return c


def test_the_registry_lists_glue_and_squad():
    assert tasks.names() == ("glue", "squad")
    assert tasks.kind_for("sst2") is tasks.GlueTask and tasks.kind_for("SST-2") is tasks.GlueTask
    assert tasks.kind_for("squad") is tasks.SquadTask
    with pytest.raises(ValueError, match="built in"):
        tasks.unregister("glue")


def test_an_unknown_task_is_one_line_naming_the_known_ones(tmp_path, tiny_tokenizer):
    c = finetune_config.finetune_defaults()
    c.task, c.tokenizer_path, c.data.data_dir = "sst3", tiny_tokenizer.model_path, str(tmp_path)
    with pytest.raises(finetune_config.FinetuneConfigError) as info:
        train.run(c, str(tmp_path / "run"))
    message = str(info.value)
    assert message.startswith("config.task: expected a GLUE task (CoLA, SST-2,")
    assert message.endswith("or squad, got 'sst3'") and "\n" not in message
    assert not (tmp_path / "run").exists()


def test_a_registered_kind_is_one_of_the_known_values(keyword_kind):
    assert tasks.names() == ("glue", "squad", "keyword")
    assert tasks.kind_for("keyword") is KeywordTask
    with pytest.raises(finetune_config.FinetuneConfigError, match=r"squad or keyword, got 'x'$"):
        tasks.kind_for("x")
    with pytest.raises(ValueError, match="already registered"):
        tasks.register(KeywordTask)
    with pytest.raises(finetune_config.FinetuneConfigError,
                       match=r"^config.task: keyword has no paper grid"):
        finetune_config.paper_grid("keyword")
    # Its fields are part of every fine-tuning config while it is registered.
    assert finetune_config.finetune_defaults().keyword.word == "good"
    assert "keyword.path" in finetune_config.fields()


def _outcome(workdir):
    results = json.loads((workdir / "results.json").read_text())
    for key in ("wall_seconds", "files"):
        results.pop(key)
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    for record in metrics:
        record.pop("examples_per_sec", None)
    return results, metrics


def test_a_new_kind_fine_tunes_resumes_and_reads_back(keyword_config, tmp_path, tiny_tokenizer,
                                                     monkeypatch):
    whole = tmp_path / "whole"
    results = train.run(keyword_config, str(whole))
    assert results["task"] == "Keyword" and results["primary_metric"] == "accuracy"
    assert [e["step"] for e in results["evals"]] == [6, 12]
    assert 0.0 <= results["dev"]["accuracy"] <= 100.0
    assert json.loads((whole / "results.json").read_text())["dev"] == results["dev"]
    # The workdir's config.json reads back over the defaults, the kind's fields included,
    # and the rank analysis reads the run's dev set through the kind.
    recorded = run_configs.recorded_config(whole)
    assert recorded.task == "keyword" and recorded.keyword.word == "good"
    assert len(inputs.finetune_dev(recorded, tiny_tokenizer, 32)) == 16
    with pytest.raises(ExportError, match=r"^config.init_from: a fine-tuned keyword task "):
        export_run.finetuning_config({}, recorded)

    # SIGTERM during the first evaluation: the run saves step 6 and stops; the same command
    # then ends exactly where the uninterrupted run ended.
    real, calls = KeywordTask.score, []

    def score(task, run_eval):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(task, run_eval)

    monkeypatch.setattr(KeywordTask, "score", score)
    interrupted = tmp_path / "interrupted"
    with pytest.raises(preemption.Preempted):
        train.run(keyword_config, str(interrupted))
    saved = sorted(p.name for p in (interrupted / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == ["6"]
    assert not (interrupted / "results.json").exists()
    train.run(keyword_config, str(interrupted))
    assert len(calls) == 2  # step 6's evaluation came from the checkpoint
    assert _outcome(interrupted) == _outcome(whole)


@pytest.mark.parametrize("field, value, message", [
    ("word", None, r"^config.keyword.word: expected a word, got None$"),
    ("word", "two words", r"^config.keyword.word: expected one word, got 'two words'$"),
    ("path", "", r"^config.keyword.path: expected a JSON file of texts, got nothing$"),
])
def test_a_new_kinds_own_fields_are_checked(keyword_config, tmp_path, field, value, message):
    keyword_config.keyword[field] = value
    with pytest.raises(finetune_config.FinetuneConfigError, match=message):
        train.run(keyword_config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_mistyped_field_of_a_kind_is_named(keyword_config, tmp_path):
    keyword_config.keyword.wrod = "good"
    with pytest.raises(finetune_config.FinetuneConfigError,
                       match=r"^config.keyword.wrod: unknown field; did you mean "
                             r"config.keyword.word\?"):
        train.run(keyword_config, str(tmp_path / "run"))
