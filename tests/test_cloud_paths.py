"""Runs whose every file is in a bucket: pretraining with --workdir=gs://bucket/run (its
corpus there too), its resumption, and fine-tuning from it into gs://bucket/sst2 with the
GLUE files in the bucket, on a fake gs:// (tests/fake_bucket.py) that maps the bucket
onto a local directory. Every file must land in the bucket, and nothing anywhere else:
not in the current directory, where pathlib would have made gs://bucket/run the local
directory gs:/bucket/run.
"""

import json
import types

import numpy as np
import pytest

from configs.finetune import glue as glue_config
from maelm_jax import runs
from maelm_jax.fill_mask import config as fill_mask_config
from maelm_jax.fill_mask import run as fill_mask_run
from maelm_jax.finetune import train
from maelm_jax.infra import paths
from maelm_jax.models import builder
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.text import tokenizer as tokenizer_lib
from maelm_jax.workdirs import layout

from fake_bucket import fake_gcs
from support import made_up_documents
from tiny_config import tiny_config

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
pytestmark = pytest.mark.tier("slow")

WORDS = {1: ["good", "great", "fine", "lovely", "fun"], 0: ["bad", "awful", "poor", "dull"]}


def _sst2_rows(n: int, seed: int, labelled: bool = True) -> str:
    rng = np.random.default_rng(seed)
    rows = ["sentence\tlabel" if labelled else "index\tsentence"]
    for i, label in enumerate(rng.integers(2, size=n)):
        text = f"the film was {rng.choice(WORDS[int(label)])} and long"
        rows.append(f"{text}\t{label}" if labelled else f"{i}\t{text}")
    return "\n".join(rows) + "\n"


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """gs://bucket is <root>/bucket, holding a corpus and SST-2 files; the tests run in an
    empty current directory."""
    root = tmp_path_factory.mktemp("gcs")
    corpus = root / "bucket" / "corpus"
    corpus.mkdir(parents=True)
    documents = made_up_documents(400)
    for part in range(2):
        (corpus / f"part-{part}.txt").write_text("\n\n".join(documents[part::2]) + "\n")
    sst2 = root / "bucket" / "glue" / "SST-2"
    sst2.mkdir(parents=True)
    (sst2 / "train.tsv").write_text(_sst2_rows(48, 0))
    (sst2 / "dev.tsv").write_text(_sst2_rows(16, 1))
    (sst2 / "test.tsv").write_text(_sst2_rows(8, 2, labelled=False))
    cwd = tmp_path_factory.mktemp("cwd")
    with fake_gcs(root), pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        yield types.SimpleNamespace(root=root / "bucket", cwd=cwd)


def _pretrain_config(num_steps: int):
    c = tiny_config("maelm")  # its tokenizer is trained into the workdir
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = "gs://bucket/corpus/*.txt"
    c.train.num_steps = num_steps
    c.train.checkpoint_every = 5
    c.train.eval_every = 5
    return c


@pytest.fixture(scope="module")
def pretrained(bucket):
    """10 steps, then resumed to 14: gs://bucket/run."""
    pretrain_train.train_and_evaluate(_pretrain_config(10), "gs://bucket/run")
    first = sorted(p.name for p in (bucket.root / "run" / "tensorboard").iterdir())
    pretrain_train.train_and_evaluate(_pretrain_config(14), "gs://bucket/run")
    return types.SimpleNamespace(run=bucket.root / "run", first_events=first)


def test_pretraining_and_its_resumption_write_only_into_the_bucket(bucket, pretrained):
    run = pretrained.run
    recorded = json.loads((run / "config.json").read_text())
    assert recorded["data"]["sources"]["main"]["path"] == "gs://bucket/corpus/*.txt"
    assert recorded["train"]["num_steps"] == 14
    assert (run / "tokenizer.model").stat().st_size > 0
    (data,) = (run / "data").iterdir()
    assert sorted(p.name for p in data.iterdir()) == [
        "manifest.json", "tokenizer.model", "train_main-00000-of-00001.blocks",
        "valid_main-00000-of-00001.blocks"]
    # The bucket's commit files mark finished steps; the digests were written after them.
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir())
    assert steps == [5, 10, 14]
    for step in steps:
        assert (run / "checkpoints" / str(step) / "commit_success.txt").is_file()
        digests = json.loads((run / "checkpoints" / str(step) / "digests.json").read_text())
        assert any(name.startswith("state/") for name in digests)
    # One line per (split, step), though steps 11-14 ran in a second process's writer.
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["split"] == "train"] == list(range(1, 15))
    assert [r["step"] for r in lines if r["split"] == "eval"] == [5, 10, 14]
    events = sorted(p.name for p in (run / "tensorboard").iterdir())
    assert len(pretrained.first_events) == 1 and len(events) == 2
    assert all(name.startswith("events.out.tfevents.") for name in events)
    assert list(bucket.cwd.iterdir()) == []


def test_fill_mask_reads_the_bucket(bucket, pretrained):
    c = fill_mask_config.fill_mask_defaults()
    c.text = "the <mask> module"
    (filled,) = fill_mask_run.run(c, "gs://bucket/run")
    assert filled.top_ids.shape == (1, c.top_k)
    tok = tokenizer_lib.load_tokenizer("gs://bucket/run/tokenizer.model")
    fill_mask_run.write_examples(paths.Path("gs://bucket/run"), [filled], tok, 14)
    assert "<mask>" in (pretrained.run / "fill_mask.md").read_text()
    assert list(bucket.cwd.iterdir()) == []


def test_finetuning_reads_and_writes_the_bucket(bucket, pretrained):
    c = glue_config.get_config("sst2")
    c.init_from = "gs://bucket/run"
    c.data.data_dir = "gs://bucket/glue"
    c.data.max_seq_len = 32
    c.data.buckets = (32,)
    c.mesh.shape = (1, 1, 1)
    c.fast_compile = True
    c.train.batch_size, c.train.eval_batch_size = 8, 16
    c.train.num_epochs, c.train.learning_rate = 1, 1e-3
    c.train.checkpoint_every = 3  # a resume checkpoint in the bucket on the way
    results = train.run(c, "gs://bucket/sst2")
    out = bucket.root / "sst2"
    assert json.loads((out / "results.json").read_text())["dev"] == results["dev"]
    assert json.loads((out / "config.json").read_text())["init_from"] == "gs://bucket/run"
    assert (out / "metrics.jsonl").read_text().count('"split": "dev"') == len(results["evals"])
    assert any((out / "tensorboard").iterdir())
    assert len((out / "predictions" / "SST-2.tsv").read_text().splitlines()) == 1 + 8
    # Finished: its resume states are gone, the final checkpoint alone stays.
    assert [p.name for p in (out / "checkpoints").iterdir()] == [str(results["dev"]["step"])]
    assert (out / "tokenizer.model").read_bytes() == (
        pretrained.run / "tokenizer.model").read_bytes()
    # The fine-tuned workdir in the bucket is itself an init_from.
    again = runs.load_pretrained("gs://bucket/sst2", builder.Run())
    assert again.description.startswith("fine-tuning checkpoint gs://bucket/sst2/checkpoints/")
    assert list(bucket.cwd.iterdir()) == []


def test_paths_in_a_bucket_stay_uris(bucket):
    c = tiny_config()
    c.tokenizer.model_path = "gs://bucket/run/tokenizer.model"
    c.data.cache_dir = "gs://bucket/cache"
    c.data.sources.main.kind = "text"
    c.data.sources.main.path = ["gs://bucket/corpus/part-0.txt", "local.txt"]
    resolved = pretrain_config.resolve_paths(c)
    assert resolved.tokenizer.model_path == "gs://bucket/run/tokenizer.model"
    assert resolved.data.cache_dir == "gs://bucket/cache"
    assert resolved.data.sources.main.path == ["gs://bucket/corpus/part-0.txt",
                                               str(bucket.cwd / "local.txt")]
    assert str(paths.resolve("gs://bucket/a/b", "--workdir") / "c") == "gs://bucket/a/b/c"


def test_a_missing_bucket_is_one_line(bucket):
    with pytest.raises(layout.WorkdirError,
                       match=r"^--workdir gs://nobucket/run: the bucket gs://nobucket does not "
                             r"exist or cannot be read; create it"):
        pretrain_train.train_and_evaluate(tiny_config(), "gs://nobucket/run")
    assert not (bucket.root.parent / "nobucket").exists()
