"""The export to Hugging Face transformers: the PyTorch model of every architecture computes
what ours does, the tokenizer gives our ids, and exported runs load with the Auto classes
in a fresh process and match our outputs (fill-mask's top 5 included).

Needs PyTorch and transformers (requirements-hf.txt, which .ci/run installs).
"""

import ast
import json
import os
import stat
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from configs.finetune import glue as glue_config
from configs.finetune import squad as squad_config
from configs.pretrain import quickstart as quickstart_config
from maelm_jax import run_configs, runs
from maelm_jax.export import config as export_config
from maelm_jax.export import run as export_run
from maelm_jax.fill_mask import run as fill_mask_run
from maelm_jax.finetune import data as finetune_data
from maelm_jax.finetune import heads
from maelm_jax.finetune import train as finetune_train
from maelm_jax.models import builder, relative_position, torch_names
from maelm_jax.models import encoder as encoder_lib
from maelm_jax.pretrain import config as pretrain_config
from maelm_jax.pretrain import setup as setup_lib
from maelm_jax.pretrain import train as pretrain_train
from maelm_jax.pretrain.objectives import recipes
from maelm_jax.sources import source as source_lib
from maelm_jax.text import masking
from maelm_jax.text import tokenizer as tokenizer_lib

from conftest import REPO_ROOT, subprocess_env
from tiny_config import TINY_VOCAB, tiny_config

# End-to-end: left out of the fast inner loop (pytest -m "not slow").
SP = tokenizer_lib.SENTENCEPIECE_IDS
pytestmark = pytest.mark.tier("slow")

torch = pytest.importorskip("torch", reason="the export's tests need PyTorch "
                            "(pip install -r requirements-hf.txt)")
pytest.importorskip("transformers", reason="the export's tests need transformers "
                    "(pip install -r requirements-hf.txt)")

from maelm_jax.export.remote import (  # noqa: E402 (after the skips)
    configuration_maelm,
    modeling_maelm,
    tokenization_maelm,
)

TOLERANCE = 1e-4  # float32, ours against PyTorch
# Texts of different lengths with masks at different places: a padded batch in PyTorch.
IDS = [[1, 40, 41, 4, 43, 44, 4, 46, 2], [1, 50, 4, 52, 53, 2]]

# Every architecture the pretraining configs offer: the papers' four models, pre- and
# post-LN, absolute positions only and each bucketing, the decoder options and kinds.
ARCHITECTURES = {
    "mlm": ("mlm", {}),
    "mlm_pre_ln_no_relative": ("mlm", {"model.pre_ln": True, "model.rel_pos_buckets": 0}),
    "mlm_maelm_buckets": ("mlm", {"model.rel_pos_bucket_fn": "maelm"}),
    "maelm": ("maelm", {}),
    "maelm_pre_ln_decoder_bias": ("maelm", {
        "model.pre_ln": True, "model.decoder.pre_ln": True,
        "model.decoder.rel_pos_buckets": 8, "model.decoder.rel_pos_max_distance": 16,
        "model.rel_pos_bucket_fn": "maelm"}),
    "maelm_shared_positions_misaligned": ("maelm", {
        "model.decoder.share_positions": True, "model.misaligned_positions": True}),
    "3ml_self": ("3ml_self", {}),
    "3ml_cross": ("3ml_cross", {"model.decoder.rel_pos_buckets": 8}),
    "causal_cross": ("maelm", {"model.decoder.kind": "causal_cross"}),
    "cross_only_misaligned": ("maelm", {"model.decoder.kind": "cross_only",
                                        "model.misaligned_positions": True}),
}


def _config(recipe: str, changes: dict, tokenizer_path: str = ""):
    c = recipes.MODELS[recipe].apply(tiny_config("maelm", tokenizer_path))
    for name, value in changes.items():
        *sections, field = name.split(".")
        node = c
        for section in sections:
            node = node[section]
        node[field] = value
    pretrain_config.validate(c)
    return c


def _perturbed(params, seed=1):
    """Every parameter moved off its initial value (LayerNorm scales of 1, zero biases),
    so that a parameter mapped to the wrong place shows."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [np.asarray(x + 0.1 * jax.random.normal(k, x.shape))
                                     for x, k in zip(leaves, keys, strict=True)])


def _torch_model(cls, hf_config: dict, params, head=None):
    """The PyTorch model of `hf_config` with our parameters, loaded strictly: every tensor
    of the model is given, and nothing else."""
    model = cls(configuration_maelm.MaelmConfig.from_dict(hf_config))
    state = {k: torch.from_numpy(v.copy()) for k, v in torch_names.state_dict(params, head).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def _padded(rows):
    n = max(map(len, rows))
    ids = np.zeros((len(rows), n), np.int64)
    mask = np.zeros((len(rows), n), np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def _our_logits(c, params, ids):
    """Our model's logits [k, V] at the <mask>s of one text, as fill-mask computes them."""
    ids = np.asarray(ids, np.int32)
    masked = np.flatnonzero(ids == SP.mask).astype(np.int32)
    objective = pretrain_config.objective(c)
    cfg, fitted = objective.for_length(setup_lib.model_config(c, TINY_VOCAB), params, len(ids))
    kept = np.setdiff1d(np.arange(len(ids), dtype=np.int32), masked)
    batch = masking.MaskedBatch(
        inputs=ids[None], enc_index=(kept if objective.removes_masks
                                     else np.arange(len(ids), dtype=np.int32))[None],
        pred_index=masked[None], targets=np.zeros((1, len(masked)), np.int32),
        weights=np.ones((1, len(masked)), np.float32))
    return np.asarray(objective.model(cfg).apply({"params": fitted}, batch))[0], masked


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_every_architecture_computes_ours_in_pytorch(name):
    recipe, changes = ARCHITECTURES[name]
    c = _config(recipe, changes)
    model = setup_lib.model(c, TINY_VOCAB)
    batch = jax.tree.map(np.asarray, masking.apply_mask(
        jax.random.PRNGKey(0), jax.numpy.full((1, c.data.seq_len), 7, np.int32),
        pretrain_config.mask_counts(c), TINY_VOCAB, tokenizer_lib.SENTENCEPIECE_IDS))
    params = _perturbed(nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch))["params"])
    hf_config = export_run.pretraining_config(c, TINY_VOCAB)
    torch_model = _torch_model(modeling_maelm.MaelmForMaskedLM, hf_config, params)
    ids, mask = _padded(IDS)
    with torch.no_grad():
        # The encoder alone (AutoModel): every position, the second row padded.
        hidden = torch_model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = torch_model(input_ids=ids, attention_mask=mask).logits.numpy()
    encoder_cfg = setup_lib.model_config(c, TINY_VOCAB).encoder
    for row, text in enumerate(IDS):
        n = len(text)
        ours = encoder_lib.Encoder(encoder_cfg).apply(
            {"params": params["encoder"]}, np.asarray([text], np.int32),
            np.arange(n, dtype=np.int32)[None])
        np.testing.assert_allclose(hidden[row, :n].numpy(), np.asarray(ours)[0],
                                   atol=TOLERANCE, rtol=TOLERANCE)
        expected, masked = _our_logits(c, params, text)
        np.testing.assert_allclose(logits[row, masked], expected, atol=TOLERANCE,
                                   rtol=TOLERANCE)


def test_a_plain_encoder_exports_in_the_stock_roberta_classes(tiny_tokenizer, tmp_path):
    """classes="roberta": a post-LN MLM run without the relative bias is transformers' own
    RobertaForMaskedLM (loaded without trust_remote_code, its tokenizer a plain fast one)
    computing our hidden states and masked-LM logits; a model RoBERTa cannot hold is one
    line."""
    from safetensors.numpy import save_file
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    c = _config("mlm", {"model.rel_pos_buckets": 0}, tiny_tokenizer.model_path)
    model = setup_lib.model(c, TINY_VOCAB)
    batch = jax.tree.map(np.asarray, masking.apply_mask(
        jax.random.PRNGKey(0), jax.numpy.full((1, c.data.seq_len), 7, np.int32),
        pretrain_config.mask_counts(c), TINY_VOCAB, SP))
    params = _perturbed(nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch))["params"])
    exported = {"hf_config": export_run.pretraining_config(c, TINY_VOCAB),
                "state": torch_names.state_dict(params), "tokenizer": tiny_tokenizer,
                "recorded": c.to_dict(), "run_dir": tmp_path, "facts": {
                    "kind": "pretraining", "objective": "MLM", "step": 1, "tokens_seen": 1,
                    "metrics": {}, "corpus": None, "max_length": c.data.seq_len,
                    "tokenizer": "SentencePiece"}}
    files = export_run._files(exported, "roberta")
    out = tmp_path / "roberta"
    out.mkdir()
    for name, content in files.items():
        if name == export_run.WEIGHTS_FILE:
            save_file(content, str(out / name), metadata={"format": "pt"})
        else:
            (out / name).write_bytes(content)
    assert not any(name.endswith(".py") for name in files) and "trust_remote" not in (
        out / "README.md").read_text().split("## How it was made")[0]
    torch_model = AutoModelForMaskedLM.from_pretrained(str(out)).eval()
    assert type(torch_model).__name__ == "RobertaForMaskedLM"
    tok = AutoTokenizer.from_pretrained(str(out))
    texts = ["Return a <mask> of the items in the <mask>.", "The <mask> module."]
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out_hf = torch_model(**enc, output_hidden_states=True)
    encoder_cfg = setup_lib.model_config(c, TINY_VOCAB).encoder
    for row in range(len(texts)):
        ids = [t for t in enc["input_ids"][row].tolist() if t != SP.pad]
        ours = encoder_lib.Encoder(encoder_cfg).apply(
            {"params": params["encoder"]}, np.asarray([ids], np.int32),
            np.arange(len(ids), dtype=np.int32)[None])
        np.testing.assert_allclose(out_hf.hidden_states[-1][row, :len(ids)].numpy(),
                                   np.asarray(ours)[0], atol=TOLERANCE, rtol=TOLERANCE)
        expected, masked = _our_logits(c, params, ids)
        np.testing.assert_allclose(out_hf.logits[row, masked].numpy(), expected,
                                   atol=TOLERANCE, rtol=TOLERANCE)
    # Imported back (sources/huggingface.py reads the one table of names the other way):
    # every parameter as it was.
    back = source_lib.read(str(out)).params()
    want = dict(jax.tree_util.tree_leaves_with_path(params))
    assert sorted(map(jax.tree_util.keystr, want)) == sorted(
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(back))
    for k, v in jax.tree_util.tree_leaves_with_path(back):
        np.testing.assert_array_equal(v, np.asarray(want[k]), err_msg=jax.tree_util.keystr(k))
    exported["hf_config"] = export_run.pretraining_config(_config("mlm", {}), TINY_VOCAB)
    with pytest.raises(export_config.ExportError, match=r"^config.classes: 'roberta' needs a "
                       r"plain RoBERTa encoder .*model.rel_pos_buckets=8;"):
        export_run._files(exported, "roberta")


def test_bucketing_is_ours_at_every_distance():
    relative = np.arange(-2048, 2049)
    for fn in ("t5", "maelm"):
        for buckets, distance in ((8, 16), (32, 128), (32, 512), (64, 256), (128, 1024)):
            ours = np.asarray(relative_position.BUCKET_FNS[fn](relative, buckets, distance))
            theirs = modeling_maelm.BUCKET_FNS[fn](torch.from_numpy(relative), buckets,
                                                   distance).numpy()
            np.testing.assert_array_equal(theirs, ours, err_msg=f"{fn} {buckets} {distance}")


def _finetune_cfg(task: str, pooling: str = "first"):
    c = (squad_config.get_config("v2") if task == "squad" else glue_config.get_config(task))
    c.model.pooling = pooling
    return c


@pytest.mark.parametrize("task,pooling", [("rte", "first"), ("stsb", "mean"),
                                          ("squad", "first")])
def test_heads_compute_ours_in_pytorch(task, pooling):
    c = tiny_config("mlm")
    encoder_cfg = setup_lib.model_config(c, TINY_VOCAB).encoder
    arch = encoder_lib.architecture(encoder_cfg)
    hf_config, head, _ = export_run.finetuning_config(arch, _finetune_cfg(task, pooling))
    # A question and a context: the span head's allowed positions depend on the </s>s.
    rows = [[1, 30, 31, 2, 2, 40, 41, 42, 43, 2], [1, 30, 2, 2, 50, 51, 2]]
    ids, mask = _padded(rows)
    tokens, key_mask = ids.numpy().astype(np.int32), mask.numpy().astype(bool)
    if head == "qa_outputs":
        ours_model, cls = heads.SpanExtractor(encoder_cfg), \
            modeling_maelm.MaelmForQuestionAnswering
    else:
        ours_model = heads.SequenceClassifier(encoder_cfg, len(hf_config["id2label"]),
                                              pooling=pooling)
        cls = modeling_maelm.MaelmForSequenceClassification
    params = _perturbed(nn.meta.unbox(ours_model.init(jax.random.PRNGKey(0), tokens,
                                                      key_mask))["params"])
    ours = ours_model.apply({"params": params}, tokens, key_mask)
    with torch.no_grad():
        out = _torch_model(cls, hf_config, params, head)(input_ids=ids, attention_mask=mask)
    if head == "qa_outputs":
        for theirs, expected in ((out.start_logits, ours[0]), (out.end_logits, ours[1])):
            np.testing.assert_allclose(theirs.numpy(), np.asarray(expected), atol=TOLERANCE,
                                       rtol=TOLERANCE)
    else:
        np.testing.assert_allclose(out.logits.numpy(), np.asarray(ours), atol=TOLERANCE,
                                   rtol=TOLERANCE)


TEXTS = ["The cat sat on the mat.", "Zürich, São Paulo — naïve café 東京 😀 ½",
         "tabs\tand  double  spaces", "a literal <s> and </s> stay text",
         " ".join(["a long sentence"] * 40)]


def test_the_tokenizer_gives_our_ids(tiny_tokenizer):
    hf = tokenization_maelm.MaelmTokenizer(vocab_file=tiny_tokenizer.model_path,
                                           model_max_length=32)
    for text in TEXTS:
        assert hf(text, truncation=True)["input_ids"] == finetune_data.encode_texts(
            tiny_tokenizer, [[text]], 32)[0].tolist(), text
    firsts, seconds = TEXTS, TEXTS[::-1]
    ours = finetune_data.encode_texts(tiny_tokenizer, [firsts, seconds], 32)
    got = hf(firsts, seconds, truncation=True)["input_ids"]
    assert got == [row.tolist() for row in ours]
    assert max(map(len, got)) == 32  # the long pairs were truncated, longest first
    # The special tokens are RoBERTa's roles on our ids.
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.mask_token_id) == (
        SP.bos, SP.eos, SP.pad, SP.mask)
    assert hf.cls_token_id == SP.bos and hf.sep_token_id == SP.eos


# ------------------------------------------------------------------ exported runs, end to end


def _write_glue(directory, task, columns, label):
    rng = np.random.default_rng(0)
    words = ["good", "bad", "film", "long", "the", "was", "a", "house", "tree"]
    for split in ("train", "dev"):
        rows = ["index\t" + "\t".join(columns) + f"\t{'score' if task == 'STS-B' else 'label'}"]
        for i in range(24):
            texts = ["the " + " ".join(rng.choice(words, 5)) for _ in columns]
            rows.append(f"{i}\t" + "\t".join(texts) + f"\t{label(rng)}")
        (directory / task).mkdir(parents=True, exist_ok=True)
        (directory / task / f"{split}.tsv").write_text("\n".join(rows) + "\n")


SQUAD_CONTEXT = "the house by the tree was built in the long summer of the good year"


def _write_squad(path):
    context = SQUAD_CONTEXT
    qas = [{"id": "a", "question": "what was built", "is_impossible": False,
            "answers": [{"text": "the house", "answer_start": 0}]},
           {"id": "b", "question": "who sang", "is_impossible": True, "answers": []}]
    path.write_text(json.dumps({"version": "v2.0", "data": [
        {"title": "t", "paragraphs": [{"context": context, "qas": qas * 4}]}]}))


def _tiny_finetune(c, init_from):
    c.init_from = str(init_from)
    c.model.dropout = c.model.attention_dropout = 0.0
    c.data.max_seq_len, c.data.buckets = MAX_LEN, (MAX_LEN,)
    c.train.batch_size = c.train.eval_batch_size = 8
    c.train.num_epochs = 1
    c.mesh.shape, c.fast_compile, c.predict_test = (1, 1, 1), True, False
    return c


# The README quickstart's config, for a few steps: its tokenizer, sizes and sequence length.
QUICK_STEPS = ("--config.train.num_steps=4", "--config.train.checkpoint_every=4",
               "--config.train.eval_every=4", "--config.train.eval_batches=2",
               "--config.train.log_every=2", "--config.train.fill_mask_examples=1")
MAX_LEN = 64  # the quickstart's data.seq_len, and the fine-tuning runs' max_seq_len


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The README quickstart (MAE-LM) and its :mlm variant through main.py for 4 steps,
    3ML_cross on the same config and tokenizer, three fine-tuning runs from the MAE-LM one
    (RTE, STS-B, SQuAD 2.0); each exported, the MLM run through main.py. (3ML_self's
    decoder is MAE-LM's kind at another width; the architecture test above holds its
    export.)"""
    tmp = tmp_path_factory.mktemp("export")
    out = {}
    for name, arg in (("maelm", ""), ("mlm", ":mlm")):
        shared = ([f"--config.tokenizer.model_path={tmp / 'maelm' / 'tokenizer.model'}"]
                  if name == "mlm" else [])  # one tokenizer, trained by the first run
        subprocess.run([sys.executable, "main.py", f"--config=configs/pretrain/quickstart.py{arg}",
                        f"--workdir={tmp / name}", *QUICK_STEPS, *shared], cwd=REPO_ROOT,
                       env=subprocess_env(1), check=True, capture_output=True, text=True)
        out[name] = (tmp / name, tmp / f"{name}_hf")
    c = recipes.MODELS["3ml_cross"].apply(quickstart_config.get_config())
    c.tokenizer.model_path = str(tmp / "maelm" / "tokenizer.model")
    c.train.num_steps = c.train.checkpoint_every = c.train.eval_every = 4
    c.train.eval_batches, c.train.fill_mask_examples = 2, 0
    pretrain_train.train_and_evaluate(c, str(tmp / "3ml_cross"))
    out["3ml_cross"] = (tmp / "3ml_cross", tmp / "3ml_cross_hf")
    glue_dir = tmp / "glue"
    _write_glue(glue_dir, "RTE", ("sentence1", "sentence2"),
                lambda rng: rng.choice(["entailment", "not_entailment"]))
    _write_glue(glue_dir, "STS-B", ("sentence1", "sentence2"),
                lambda rng: f"{rng.uniform(0, 5):.2f}")
    for task in ("rte", "stsb"):
        c = _tiny_finetune(glue_config.get_config(task), tmp / "maelm")
        c.data.data_dir = str(glue_dir)
        finetune_train.run(c, str(tmp / task))
        out[task] = (tmp / task, tmp / f"{task}_hf")
    _write_squad(tmp / "squad.json")
    c = _tiny_finetune(squad_config.get_config("v2"), tmp / "maelm")
    c.squad.train_file = c.squad.dev_file = str(tmp / "squad.json")
    c.squad.doc_stride, c.squad.max_query_len = 16, 8
    finetune_train.run(c, str(tmp / "squad"))
    out["squad"] = (tmp / "squad", tmp / "squad_hf")
    for name, (run_dir, export_dir) in out.items():
        if name == "mlm":
            subprocess.run([sys.executable, "main.py", "--config=configs/export.py",
                            f"--workdir={export_dir}", f"--config.init_from={run_dir}"],
                           cwd=REPO_ROOT, env=subprocess_env(1), check=True,
                           capture_output=True, text=True)
        else:
            c = export_config.export_defaults()
            c.init_from = str(run_dir)
            export_run.run(c, str(export_dir))
    return out


# What a user does in a fresh process: the Auto classes and the fill-mask pipeline.
_LOAD = """
import json, sys
sys.modules["maelm_jax"] = sys.modules["jax"] = None  # the export must not need them
import numpy as np, torch
from transformers import (AutoModel, AutoModelForMaskedLM, AutoModelForQuestionAnswering,
                          AutoModelForSequenceClassification, AutoTokenizer, pipeline)
spec = json.loads(sys.argv[1])
kw = {"trust_remote_code": True}
out = {}
for name, (path, kind) in spec["exports"].items():
    tok = AutoTokenizer.from_pretrained(path, **kw)
    enc = tok(spec["texts"], spec["pairs"], padding=True, truncation=True, return_tensors="pt")
    out[name + "/ids"] = enc["input_ids"].numpy()
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(path, **kw)(**enc).last_hidden_state
        out[name + "/hidden"] = hidden.numpy()
        if kind == "pretraining":
            fill = pipeline("fill-mask", model=AutoModelForMaskedLM.from_pretrained(path, **kw),
                            tokenizer=tok, top_k=5)
            for i, text in enumerate(spec["masked"]):
                found = fill(text)
                found = found if isinstance(found[0], list) else [found]
                out[f"{name}/fill/{i}"] = np.asarray([[r["token"] for r in m] for m in found])
        elif kind == "qa":
            model = AutoModelForQuestionAnswering.from_pretrained(path, **kw)
            r = model(**enc)
            out[name + "/start"], out[name + "/end"] = r.start_logits.numpy(), r.end_logits.numpy()
            # run_qa.py's preparation: windows with offsets, the answer's tokens from them.
            qa = spec["qa"]
            first, last = qa["answer_start"], qa["answer_start"] + len(qa["answer"])
            f = tok(qa["question"], qa["context"], truncation="only_second", max_length=16,
                    stride=4, return_overflowing_tokens=True, return_offsets_mapping=True,
                    padding="max_length")
            spans = []
            for i, offsets in enumerate(f["offset_mapping"]):
                context = [j for j, s in enumerate(f.sequence_ids(i)) if s == 1]
                if offsets[context[0]][0] <= first and offsets[context[-1]][1] >= last:
                    start = next(j for j in context if offsets[j][1] > first)
                    end = next(j for j in context[::-1] if offsets[j][0] < last)
                    spans.append(qa["context"][offsets[start][0]:offsets[end][1]])
            out[name + "/qa_spans"] = np.asarray(spans)
            ids, mask = torch.tensor(f["input_ids"]), torch.tensor(f["attention_mask"])
            out[name + "/qa_ids"], out[name + "/qa_mask"] = ids.numpy(), mask.numpy()
            out[name + "/qa_start"] = model(input_ids=ids, attention_mask=mask).start_logits.numpy()
        else:
            model = AutoModelForSequenceClassification.from_pretrained(path, **kw)
            out[name + "/logits"] = model(**enc).logits.numpy()
            out[name + "/labels"] = np.asarray(list(model.config.id2label.values()))
# Fine-tuning an export with transformers' Trainer, as the README shows: a new head on the
# pretrained encoder, and both trained.
from transformers import Trainer, TrainingArguments
path = spec["trainer"]
tok = AutoTokenizer.from_pretrained(path, **kw)
model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, **kw)
before = {k: v.clone() for k, v in model.state_dict().items()}
pretrained = AutoModel.from_pretrained(path, **kw).state_dict()
train = [{**tok(t, truncation=True), "labels": int("good" in t)}
         for t in ["a good film", "a bad film"] * 8]
args = TrainingArguments(output_dir=spec["out"] + ".trainer", num_train_epochs=2,
                         per_device_train_batch_size=8, learning_rate=1e-3, report_to=[],
                         use_cpu=True, save_strategy="no")
result = Trainer(model=model, args=args, train_dataset=train, processing_class=tok).train()
after = model.state_dict()
out["trainer"] = np.asarray([
    all(torch.equal(before["encoder." + k], v) for k, v in pretrained.items()),
    not torch.equal(*(d["encoder.word_embeddings.weight"] for d in (before, after))),
    not torch.equal(before["classifier.out.weight"], after["classifier.out.weight"]),
    bool(np.isfinite(result.training_loss))])
np.savez(spec["out"], **out)
"""
MASKED = ["Return a <mask> of the items in the <mask>.", "The <mask> module provides files."]
PAIRS = ["the house by the tree", "was built in the long summer of the good year"]


def test_exports_load_with_the_auto_classes_and_match_ours(exports, tmp_path):
    kinds = {"rte": "classifier", "stsb": "classifier", "squad": "qa"}
    spec = {"exports": {n: (str(e), kinds.get(n, "pretraining")) for n, (_, e) in exports.items()},
            "texts": TEXTS[:2] + ["short"], "pairs": PAIRS + ["pair"], "masked": MASKED,
            "qa": {"question": "what was built", "context": SQUAD_CONTEXT,
                   "answer": "the good year", "answer_start": SQUAD_CONTEXT.index("the good")},
            "out": str(tmp_path / "hf.npz"), "trainer": str(exports["maelm"][1])}
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    subprocess.run([sys.executable, "-c", _LOAD, json.dumps(spec)], cwd=tmp_path, env=env,
                   check=True, capture_output=True, text=True)
    hf = np.load(tmp_path / "hf.npz")
    # Trainer: the encoder loaded as pretrained, then it and the new head trained.
    assert hf["trainer"].tolist() == [True, True, True, True]
    for name, (run_dir, _) in exports.items():
        pretrained = runs.load_pretrained(str(run_dir), builder.Run())
        expected_ids = finetune_data.encode_texts(pretrained.tokenizer,
                                                  [spec["texts"], spec["pairs"]], MAX_LEN)
        ids = hf[name + "/ids"]
        for row, expected in zip(ids, expected_ids, strict=True):
            assert row[:len(expected)].tolist() == expected.tolist()
        key_mask = np.zeros(ids.shape, bool)
        for i, expected in enumerate(expected_ids):
            key_mask[i, :len(expected)] = True
        tokens = ids.astype(np.int32)
        hidden = encoder_lib.Encoder(pretrained.encoder_cfg).apply(
            {"params": pretrained.params}, tokens,
            np.arange(tokens.shape[1], dtype=np.int32)[None], key_mask)
        np.testing.assert_allclose(hf[name + "/hidden"][key_mask], np.asarray(hidden)[key_mask],
                                   atol=TOLERANCE, rtol=TOLERANCE)
        if name in ("rte", "stsb", "squad"):
            _check_head(name, run_dir, pretrained, tokens, key_mask, hf)
        else:
            masker = fill_mask_run.FillMasker.from_workdir(str(run_dir))
            for i, text in enumerate(MASKED):
                ids_, masked = masker.encode_text(text)
                _assert_same_top5(hf[f"{name}/fill/{i}"],
                                  masker.predict(ids_, masked, masker.tok.vocab_size))


def _assert_same_top5(theirs, ours):
    """transformers' fill-mask top 5 [masks, 5] is ours, rank by rank; two pieces whose
    probabilities are within float32 round-off of each other (two compiled programs may
    order them either way) count as the same rank."""
    for m, row in enumerate(theirs):
        prob = dict(zip(ours.top_ids[m].tolist(), ours.top_probs[m].tolist(), strict=True))
        for rank, piece in enumerate(row):
            assert piece == ours.top_ids[m, rank] or abs(
                prob[int(piece)] - ours.top_probs[m, rank]) < 1e-6, (m, rank, row,
                                                                     ours.top_ids[m, :5])


def _check_head(name, run_dir, pretrained, tokens, key_mask, hf):
    params = runs.restore_params(run_dir / "checkpoints" / str(runs.finished_steps(run_dir)[-1]))
    run_cfg = run_configs.recorded_config(run_dir)
    if name == "squad":
        model = heads.SpanExtractor(pretrained.encoder_cfg)
        start, end = model.apply({"params": params}, tokens, key_mask)
        np.testing.assert_allclose(hf[name + "/start"], np.asarray(start), atol=TOLERANCE,
                                   rtol=TOLERANCE)
        np.testing.assert_allclose(hf[name + "/end"], np.asarray(end), atol=TOLERANCE,
                                   rtol=TOLERANCE)
        # transformers' QA preparation (offsets -> the answer's tokens) on the fast
        # tokenizer: several windows, the answer found in those that hold it (a piece's
        # offsets take the space before it, which SQuAD's scoring drops), and the model's
        # logits over those windows ours.
        spans = [span.strip() for span in hf[name + "/qa_spans"].tolist()]
        assert len(hf[name + "/qa_ids"]) > 1 and spans == ["the good year"] * len(spans) != []
        windows, window_mask = hf[name + "/qa_ids"].astype(np.int32), hf[name + "/qa_mask"] > 0
        start, _ = model.apply({"params": params}, windows, window_mask)
        np.testing.assert_allclose(hf[name + "/qa_start"][window_mask],
                                   np.asarray(start)[window_mask], atol=TOLERANCE,
                                   rtol=TOLERANCE)
        return
    labels = {"rte": ["entailment", "not_entailment"], "stsb": ["score"]}[name]
    assert hf[name + "/labels"].tolist() == labels
    model = heads.SequenceClassifier(pretrained.encoder_cfg, len(labels),
                                     pooling=run_cfg.model.pooling)
    np.testing.assert_allclose(hf[name + "/logits"],
                               np.asarray(model.apply({"params": params}, tokens, key_mask)),
                               atol=TOLERANCE, rtol=TOLERANCE)


def test_the_export_is_a_model_directory_with_a_card(exports):
    run_dir, export_dir = exports["maelm"]
    names = sorted(p.name for p in export_dir.iterdir())
    assert names == sorted(["config.json", "configuration_maelm.py", "modeling_maelm.py",
                            "tokenization_maelm.py", "model.safetensors", "tokenizer.model",
                            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                            "README.md", "training_config.json"])
    # The shipped code imports only these (and its own files, relatively); the fresh
    # process of the test above cannot import maelm_jax or JAX at all.
    allowed = {"math", "os", "shutil", "types", "torch", "transformers", "sentencepiece"}
    for name in ("configuration_maelm.py", "modeling_maelm.py", "tokenization_maelm.py"):
        tree = ast.parse((export_dir / name).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and not node.level}
        assert imported <= allowed, (name, imported - allowed)
    card = (export_dir / "README.md").read_text()
    assert "tokens seen | 8,192" in card  # 4 steps x 32 sequences x 64 tokens
    assert "steps | 4" in card and "trust_remote_code=True" in card
    assert "corpus fingerprint | " in card and "unknown" not in card
    assert '"loss"' in card  # the last evaluation
    assert json.loads((export_dir / "training_config.json").read_text())["objective"] == "maelm"
    hf_config = json.loads((export_dir / "config.json").read_text())
    assert hf_config["auto_map"]["AutoModel"] == "modeling_maelm.MaelmModel"


def test_bad_input_is_one_line_and_leaves_nothing(exports, tmp_path):
    run_dir, _ = exports["mlm"]

    def export(init_from, workdir):
        c = export_config.export_defaults()
        c.init_from = str(init_from)
        return export_run.run(c, str(workdir))

    with pytest.raises(export_config.ExportError, match="config.init_from: .* does not exist"):
        export(tmp_path / "nothing", tmp_path / "a")
    (tmp_path / "plain").mkdir()
    with pytest.raises(export_config.ExportError, match="neither a workdir"):
        export(tmp_path / "plain", tmp_path / "a")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(export_config.ExportError, match="--workdir: .* holds other files"):
        export(run_dir, taken)
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    with pytest.raises(export_config.ExportError, match="config.init_from: expected"):
        export("", tmp_path / "a")
    # A damaged checkpoint: one of its array files cut short.
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(run_dir), str(damaged)], check=True)
    step = damaged / "checkpoints" / str(runs.finished_steps(damaged)[-1])
    victim = max((p for p in step.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(export_config.ExportError, match="cannot be restored"):
        export(damaged, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    assert not [p for p in tmp_path.iterdir() if ".export-" in p.name]


def test_a_failed_write_leaves_the_earlier_export(exports, tmp_path, monkeypatch):
    run_dir, export_dir = exports["maelm"]
    target = tmp_path / "hf"
    subprocess.run(["cp", "-r", str(export_dir), str(target)], check=True)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def fail(files, directory):
        (directory / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(export_run, "_write", fail)
    c = export_config.export_defaults()
    c.init_from = str(run_dir)
    with pytest.raises(OSError, match="disk full"):
        export_run.run(c, str(target))
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    # And a good export replaces an earlier one, with the modes the umask gives (not those
    # of the private temporary directory it was written in: the team loads it).
    monkeypatch.undo()
    umask = os.umask(0o027)
    try:
        export_run.run(c, str(target))
    finally:
        os.umask(umask)
    assert (target / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()} == {0o640}


GOLDEN_RUN = REPO_ROOT / "tests" / "golden" / "maelm_run_2026_11"


def test_a_checkpoint_from_before_the_export_existed_exports(tmp_path):
    """A tiny MAE-LM run (2 steps) written by the trainer before this module existed:
    checkpoints restore as they are, and the export computes what the run computes."""
    c = export_config.export_defaults()
    c.init_from = str(GOLDEN_RUN)
    export_run.run(c, str(tmp_path / "hf"))
    model = modeling_maelm.MaelmForMaskedLM.from_pretrained(str(tmp_path / "hf")).eval()
    run_cfg = run_configs.recorded_config(GOLDEN_RUN)
    params = runs.restore_params(GOLDEN_RUN / "checkpoints" / "2")
    ids, mask = _padded(IDS)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.numpy()
    for row, text in enumerate(IDS):
        expected, masked = _our_logits(run_cfg, params, text)
        np.testing.assert_allclose(logits[row, masked], expected, atol=TOLERANCE,
                                   rtol=TOLERANCE)
    assert "corpus fingerprint | unknown" in (tmp_path / "hf" / "README.md").read_text()
