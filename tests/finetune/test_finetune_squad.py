"""SQuAD: windows and targets, post-processing on handmade logits, readers, a tiny run."""

import json
from pathlib import Path

import numpy as np
import pytest

from configs.finetune import squad as squad_config
from maelm_jax.finetune import train
from maelm_jax.finetune.tasks import squad
from maelm_jax.text import tokenizer as tokenizer_lib

import squad_official
from conftest import require_shared_data

SP = tokenizer_lib.SENTENCEPIECE_IDS
pytestmark = pytest.mark.tier("integration")

CONTEXT = "The cat sat on the mat."
# Tokens "The", " cat", " sat", " on", " the", " mat", "." as sentencepiece reports them.
OFFSETS = np.array([(0, 3), (3, 7), (7, 11), (11, 14), (14, 18), (18, 22), (22, 23)])


def _features(windows_, context_start=4):
    """Hand-built features over CONTEXT for the given (start, length) windows."""
    masks = squad.examples.max_context_masks(windows_, len(OFFSETS))
    sequences = [np.zeros(context_start + length + 1, np.int32) for _, length in windows_]
    n = len(windows_)
    return squad.examples.SquadFeatures(
        sequences=sequences,
        example_index=np.zeros(n, np.int64),
        context_start=np.full(n, context_start),
        window_start=np.array([s for s, _ in windows_]),
        window_len=np.array([length for _, length in windows_]),
        max_context=masks,
        offsets=[OFFSETS],
        start_positions=np.zeros(n, np.int32),
        end_positions=np.zeros(n, np.int32),
    )


def _logits(feature, peaks, null=0.0, base=-5.0):
    """[n] logits: `base` everywhere, `null` at 0, {context token: value} at the peaks."""
    logits = np.full(len(feature), base, np.float32)
    logits[0] = null
    for token, value in peaks.items():
        logits[4 + token] = value
    return logits


EXAMPLE = [squad.examples.SquadExample("q", "what sat?", CONTEXT, ["cat"], [4])]


def test_best_span_maps_back_to_context_characters():
    f = _features([(0, 7)])
    start = [_logits(f.sequences[0], {1: 5.0})]  # " cat"
    end = [_logits(f.sequences[0], {2: 4.0})]  # " sat"
    p = squad.outputs.postprocess(EXAMPLE, f, start, end)
    assert p.text == {"q": "cat sat"}  # the leading space of " cat" is stripped
    assert p.null_odds["q"] == pytest.approx(0.0 - 9.0)
    assert p.nbest["q"][0]["text"] == "cat sat"
    assert sum(e["probability"] for e in p.nbest["q"]) == pytest.approx(1.0)
    assert len({e["text"] for e in p.nbest["q"]}) == len(p.nbest["q"])  # deduplicated


def test_null_answer_wins_above_the_threshold_and_only_in_v2():
    f = _features([(0, 7)])
    start = [_logits(f.sequences[0], {1: 5.0}, null=6.0)]
    end = [_logits(f.sequences[0], {2: 4.0}, null=6.0)]
    p = squad.outputs.postprocess(EXAMPLE, f, start, end)
    assert p.text["q"] == "" and p.nbest["q"][1]["text"] == "cat sat"  # below the null
    assert p.null_odds["q"] == pytest.approx(12.0 - 9.0)
    lenient = squad.outputs.postprocess(EXAMPLE, f, start, end, null_score_diff_threshold=5.0)
    assert lenient.text["q"] == "cat sat"
    v1 = squad.outputs.postprocess(EXAMPLE, f, start, end, version_2=False)
    assert v1.text["q"] == "cat sat" and all(e["text"] for e in v1.nbest["q"])


def test_spans_ending_before_their_start_or_too_long_are_rejected():
    f = _features([(0, 7)])
    # The best end ("The") comes before the best start (" on"): the span is " on the mat".
    start = [_logits(f.sequences[0], {3: 5.0})]
    end = [_logits(f.sequences[0], {0: 6.0, 5: 3.0})]
    assert squad.outputs.postprocess(EXAMPLE, f, start, end).text["q"] == "on the mat"
    # " cat ... mat" is 5 tokens; with max_answer_len 3 the best is " cat sat".
    start = [_logits(f.sequences[0], {1: 5.0})]
    end = [_logits(f.sequences[0], {5: 6.0, 2: 3.0})]
    assert squad.outputs.postprocess(EXAMPLE, f, start, end).text["q"] == "cat sat on the mat"
    short = squad.outputs.postprocess(EXAMPLE, f, start, end, max_answer_len=3)
    assert short.text["q"] == "cat sat"


@pytest.mark.parametrize("version_2", [True, False])
def test_a_question_without_any_valid_span_is_answered_empty(version_2):
    f = _features([(0, 7)])
    # The only start candidate (n_best 1) comes after the only end candidate: no span.
    start = [_logits(f.sequences[0], {4: 5.0})]
    end = [_logits(f.sequences[0], {1: 5.0})]
    p = squad.outputs.postprocess(EXAMPLE, f, start, end, n_best=1, version_2=version_2)
    assert p.text == {"q": ""}
    assert p.null_odds["q"] == squad.outputs.NO_SPAN_NULL_ODDS
    assert [e["text"] for e in p.nbest["q"]] == ([""] if version_2 else [])
    # Every span too long for max_answer_len: the same.
    start = [_logits(f.sequences[0], {0: 5.0})]
    end = [_logits(f.sequences[0], {6: 5.0})]
    p = squad.outputs.postprocess(EXAMPLE, f, start, end, n_best=1, max_answer_len=3,
                                  version_2=version_2)
    assert p.text == {"q": ""}
    scored = (squad.metrics.evaluate_v2({"q": ["cat"]}, p.text, p.null_odds) if version_2
              else squad.metrics.evaluate_v1({"q": ["cat"]}, p.text))
    assert scored["f1"] == 0.0


def test_a_start_counts_only_in_its_max_context_window():
    spans = squad.examples.windows(len(OFFSETS), 4, 2)
    assert spans == [(0, 4), (2, 4), (4, 3)]
    f = _features(spans)
    # Token 2 (" sat") has more context in window 0 (1 left/right) than in window 1 (0).
    assert f.max_context[0].tolist() == [True, True, True, False]
    assert f.max_context[1].tolist() == [False, True, True, False]
    start = [_logits(f.sequences[0], {1: 3.0}), _logits(f.sequences[1], {0: 10.0}, null=-2.0),
             _logits(f.sequences[2], {}, null=3.0)]
    end = [_logits(f.sequences[0], {1: 3.0}), _logits(f.sequences[1], {1: 10.0}),
           _logits(f.sequences[2], {}, null=3.0)]
    p = squad.outputs.postprocess(EXAMPLE, f, start, end)
    assert p.text["q"] == "cat"  # " sat on" (score 20) starts outside its max context
    assert p.null_odds["q"] == pytest.approx(-2.0 - 6.0)  # the smallest null score


def test_every_context_token_has_exactly_one_max_context_window():
    for num_tokens, max_len, stride in [(1, 5, 2), (10, 4, 3), (37, 16, 5), (37, 16, 16)]:
        spans = squad.examples.windows(num_tokens, max_len, stride)
        assert spans[0][0] == 0 and sum(spans[-1]) == num_tokens
        owners = np.zeros(num_tokens, int)
        masks = squad.examples.max_context_masks(spans, num_tokens)
        for (start, length), mask in zip(spans, masks, strict=True):
            owners[start:start + length] += mask
        assert owners.tolist() == [1] * num_tokens


@pytest.fixture(scope="module")
def sample():
    return squad.examples.read_squad_json(str(require_shared_data("squad", "dev-v2.0.sample.json")))


def test_reads_the_official_json_with_unanswerable_questions(sample):
    assert len(sample) == 65
    assert sum(not e.answers for e in sample) == 35
    first = sample[0]
    assert first.answers[0] == "France"
    assert first.context[first.answer_starts[0]:].startswith("France")


def test_windows_and_targets_map_back_to_the_answer_text(sample, tiny_tokenizer):
    max_len, stride = 96, 16  # at most 24 question tokens: windows of >= 68 context tokens
    f = squad.examples.make_features(sample, tiny_tokenizer, max_len, stride, 24, training=True)
    assert len(f) > 2 * len(sample)  # long contexts are split into overlapping windows
    found = set()
    for i, seq in enumerate(f.sequences):
        assert len(seq) <= max_len
        assert seq[0] == SP.bos and seq[-1] == SP.eos
        c0 = f.context_start[i]
        assert seq[c0 - 2] == seq[c0 - 1] == SP.eos  # <s> q </s></s> context </s>
        e = sample[f.example_index[i]]
        if f.start_positions[i] == 0:
            assert f.end_positions[i] == 0
            continue
        first = f.window_start[i] + f.start_positions[i] - c0
        last = f.window_start[i] + f.end_positions[i] - c0
        offsets = f.offsets[f.example_index[i]]
        text = e.context[offsets[first][0]:offsets[last][1]].strip()
        assert text == e.answers[0]
        found.add(e.qid)
    answerable = {e.qid for e in sample if e.answers}
    # Windows overlap by >= 52 tokens, more than any answer here: each is found whole.
    assert found == answerable


def test_reads_a_tfds_squad_v2_without_tensorflow(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    tfds.disable_progress_bar()

    class TinySquad(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("3.0.0")

        def _info(self):
            answers = tfds.features.Sequence(
                {"text": tfds.features.Text(), "answer_start": np.int32})
            features = tfds.features.FeaturesDict({
                "id": np.str_, "title": tfds.features.Text(), "context": tfds.features.Text(),
                "question": tfds.features.Text(), "is_impossible": np.bool_,
                "answers": answers, "plausible_answers": answers})
            return tfds.core.DatasetInfo(builder=self, features=features,
                                         disable_shuffling=True)

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(), "validation": self._generate_examples()}

        def _generate_examples(self):
            none = {"text": [], "answer_start": []}
            yield "a", {"id": "a", "title": "t", "context": CONTEXT, "question": "who sat?",
                        "is_impossible": False, "plausible_answers": none,
                        "answers": {"text": ["The cat", "cat"], "answer_start": [0, 4]}}
            yield "b", {"id": "b", "title": "t", "context": CONTEXT, "question": "who flew?",
                        "is_impossible": True, "answers": {"text": [], "answer_start": []},
                        "plausible_answers": {"text": ["The cat"], "answer_start": [0]}}

    TinySquad(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    examples = squad.examples.read_squad_tfds("tiny_squad", "validation", str(tmp_path))
    assert [(e.qid, e.answers, e.answer_starts) for e in examples] == [
        ("a", ["The cat", "cat"], [0, 4]), ("b", [], [])]
    assert examples[0].context == CONTEXT and examples[1].question == "who flew?"


def test_tiny_squad_v2_run_writes_official_metrics_and_predictions(tmp_path, tiny_tokenizer):
    path = str(require_shared_data("squad", "dev-v2.0.sample.json"))
    c = squad_config.get_config("v2")
    c.tokenizer_path = tiny_tokenizer.model_path  # from scratch: a tiny encoder
    c.model.num_layers, c.model.d_model, c.model.num_heads, c.model.d_ff = 1, 32, 2, 64
    c.model.rel_pos_buckets, c.model.rel_pos_max_distance, c.model.max_positions = 8, 16, 64
    c.squad.train_file = c.squad.dev_file = path
    c.squad.doc_stride, c.squad.max_query_len = 32, 24
    c.data.max_seq_len, c.data.buckets = 64, (64,)
    c.train.batch_size = c.train.eval_batch_size = 32
    c.train.num_epochs, c.train.learning_rate = 1, 1e-3
    c.mesh.shape, c.fast_compile = (1, 1, 1), True
    results = train.run(c, str(tmp_path))
    dev = results["dev"]
    for key in ("exact", "f1", "HasAns_exact", "NoAns_f1", "best_exact", "best_f1_thresh"):
        assert np.isfinite(dev[key]), key
    assert 0.0 <= dev["exact"] <= dev["f1"] + 1e-9 <= 100.0 + 1e-9
    predictions = json.loads((tmp_path / "predictions" / "predictions.json").read_text())
    null_odds = json.loads((tmp_path / "predictions" / "null_odds.json").read_text())
    assert len(predictions) == len(null_odds) == 65
    # The files are the selected parameters' (train.select best), as is dev: the official
    # script on them, with the run's threshold, gives every reported number.
    dataset = json.loads(Path(path).read_text())["data"]
    expected = squad_official.evaluate_v2(dataset, predictions, null_odds,
                                          c.squad.null_score_diff_threshold)
    assert {k: dev[k] for k in expected if k in dev} == {
        k: v for k, v in expected.items() if "total" not in k}
    assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "encoder.json").is_file()
