"""The SQuAD metrics against the official scripts (tests/squad_official.py, written from
their specification): by hand, on constructed edge cases, on real dev questions, and a
SquadTask's reported numbers against the scripts run on the files it writes."""

import json
import math
import random

import numpy as np
import pytest

from configs.finetune import squad as squad_config
from maelm_jax.finetune.tasks import squad

import squad_official as official
from conftest import require_shared_data

pytestmark = pytest.mark.tier("unit")

metrics = squad.metrics


def _v1_dataset(dataset):
    """The answerable questions of a SQuAD 2.0 "data", as a SQuAD 1.1 one."""
    return [{**article, "paragraphs": [
        {**p, "qas": [qa for qa in p["qas"] if qa["answers"]]} for p in article["paragraphs"]]}
        for article in dataset]


def _gold(dataset):
    return {qa["id"]: [a["text"] for a in qa["answers"]]
            for article in dataset for p in article["paragraphs"] for qa in p["qas"]}


def _same(ours, reference):
    """Every number the script prints, bit for bit (the counts: the task drops them)."""
    assert set(ours) <= set(reference)
    assert {k for k in reference if k not in ours} <= {k for k in reference if "total" in k}
    assert {k: ours[k] for k in ours} == {k: reference[k] for k in ours}


def _check_both_scripts(gold, preds, na_probs, thresholds=(1.0,)):
    dataset = official.dataset_of(gold)
    _same(metrics.evaluate_v2(gold, preds), official.evaluate_v2(dataset, preds))
    for t in thresholds:
        _same(metrics.evaluate_v2(gold, preds, na_probs, t),
              official.evaluate_v2(dataset, preds, na_probs, t))
    answerable = {qid: answers for qid, answers in gold.items() if answers}
    if answerable:
        _same(metrics.evaluate_v1(answerable, preds),
              official.evaluate_v1(official.dataset_of(answerable), preds))


# --- by hand ---------------------------------------------------------------------------------

def test_answer_normalisation():
    assert metrics.normalize_answer("The  Cat, a dog!") == "cat dog"
    assert metrics.normalize_answer("An apple\tand THE theory") == "apple and theory"
    assert metrics.normalize_answer("the") == ""
    # Unicode letters are word characters; "—" is not in string.punctuation, but it is a
    # word boundary, so the article after it goes.
    assert metrics.normalize_answer("Théâtre—the Ünïcode") == "théâtre— ünïcode"
    assert metrics.normalize_answer("Theory, anthem; thé") == "theory anthem thé"


def test_exact_and_f1_by_hand():
    assert metrics.compute_exact("The Denver Broncos", "denver broncos!") == 1
    # gold [cat, sat], prediction [cat, sat, down]: precision 2/3, recall 1 -> F1 0.8
    assert metrics.compute_f1("the cat sat", "cat sat down") == pytest.approx(0.8)
    assert metrics.f1_score("cat sat down", "the cat sat") == pytest.approx(0.8)
    assert metrics.compute_f1("cat", "dog") == 0.0
    # v2.0, no-answer: 1 only if both are empty (after normalisation).
    assert metrics.compute_f1("", "") == 1.0
    assert metrics.compute_f1("", "a cat") == 0.0
    assert metrics.compute_f1("cat", "") == 0.0
    assert metrics.compute_f1("", "the") == 1.0  # "the" normalises to nothing
    # v1.1: no common token is 0, even for two empty answers; exact still matches them.
    assert metrics.f1_score("", "") == 0.0 and metrics.f1_score("an the", ".") == 0.0
    assert metrics.exact_match_score("an the", ".")


def test_v1_keeps_gold_answers_that_normalise_to_nothing():
    # The cases: a gold "." against "an the", and golds that are all articles.
    assert metrics.evaluate_v1({"q": ["."]}, {"q": "an the"}) == {"exact_match": 100.0,
                                                                 "f1": 0.0}
    assert metrics.evaluate_v2({"q": ["."]}, {"q": "an the"})["f1"] == 100.0
    gold = {"q": ["a", "An!", "The"]}
    assert metrics.evaluate_v1(gold, {"q": "a"}) == {"exact_match": 100.0, "f1": 0.0}
    assert metrics.evaluate_v2(gold, {"q": "a"})["f1"] == 100.0
    # A real gold next to an empty one: the max is the real one's in both.
    assert metrics.evaluate_v1({"q": [".", "Paris"]}, {"q": "paris"})["f1"] == 100.0


def test_v1_counts_a_missing_prediction_as_zero_and_refuses_a_question_without_gold():
    out = metrics.evaluate_v1({"a": ["x"], "b": ["y"]}, {"a": "x"})
    assert out == {"exact_match": 50.0, "f1": 50.0}
    with pytest.raises(ValueError, match="question 'b' has no gold answer"):
        metrics.evaluate_v1({"a": ["x"], "b": []}, {"a": "x", "b": ""})


def test_v2_refuses_a_missing_prediction_or_no_answer_probability():
    gold = {"a": ["x"], "b": []}
    with pytest.raises(ValueError, match="no prediction for question 'b'"):
        metrics.evaluate_v2(gold, {"a": "x"})
    with pytest.raises(KeyError):  # the script: a KeyError in HasAns / NoAns
        official.evaluate_v2(official.dataset_of(gold), {"a": "x"})
    with pytest.raises(ValueError, match="no no-answer probability for question 'a'"):
        metrics.evaluate_v2(gold, {"a": "x", "b": ""}, {"b": 0.5})


GOLD = {
    "q1": ["Denver Broncos", "The Denver Broncos"],  # answerable
    "q2": [],  # unanswerable
    "q3": ["1990", "in 1990"],
    "q4": [],
}
PREDICTIONS = {"q1": "Broncos", "q2": "", "q3": "around 1990", "q4": "something"}
NA_PROBS = {"q1": 0.1, "q2": 0.9, "q3": 0.2, "q4": 0.8}


def test_official_v2_scores_by_hand():
    out = metrics.evaluate_v2(GOLD, PREDICTIONS)
    # EM: q2 only. F1: q1 max(2/3, 2/3); q2 1; q3 max over golds: vs "1990" 2/3, vs
    # "in 1990" 1/2 -> 2/3; q4 0.
    assert out["exact"] == pytest.approx(25.0)
    assert out["f1"] == pytest.approx(100 * (2 / 3 + 1 + 2 / 3 + 0) / 4)
    assert out["total"] == 4
    assert out["HasAns_exact"] == 0.0 and out["HasAns_f1"] == pytest.approx(100 * 2 / 3)
    assert out["NoAns_exact"] == 50.0 and out["NoAns_f1"] == 50.0
    assert "best_exact" not in out  # only with no-answer scores


def test_official_best_thresholds_by_hand():
    out = metrics.evaluate_v2(GOLD, PREDICTIONS, NA_PROBS)
    # Start from "everything null" (2 of 4 right), answer questions in order of na_prob:
    # exact: q1 +0, q3 +0, q4 -1, q2 +0 -> never above 2: 50 % at threshold 0.
    assert out["best_exact"] == pytest.approx(50.0) and out["best_exact_thresh"] == 0.0
    # F1: q1 +2/3 (2.67, thresh 0.1), q3 +2/3 (3.33, thresh 0.2), q4 -1, q2 0.
    assert out["best_f1"] == pytest.approx(100 * (2 + 4 / 3) / 4)
    assert out["best_f1_thresh"] == 0.2
    # The default threshold 1.0 changes nothing here; 0.5 turns q2 and q4 into "".
    assert out["exact"] == pytest.approx(25.0)
    strict = metrics.evaluate_v2(GOLD, PREDICTIONS, NA_PROBS, na_prob_thresh=0.5)
    assert strict["exact"] == pytest.approx(50.0)


def test_v2_unanswerable_gold_with_only_empty_answers_counts_as_no_answer():
    # Gold answers that normalise to "" are dropped; none left means "" is the answer...
    out = metrics.evaluate_v2({"q": ["the", "."]}, {"q": ""})
    assert out["exact"] == 100.0 and not math.isnan(out["f1"])
    # ... but the question has answers, so a forced "" (above the threshold) scores 0.
    forced = metrics.evaluate_v2({"q": ["the", "."]}, {"q": ""}, {"q": 2.0})
    assert forced["exact"] == 0.0 and forced["HasAns_total"] == 1


# --- constructed edge cases, against the scripts --------------------------------------------

EDGE_GOLD = {
    "empty_only": [".", "the", "An!"],
    "empty_and_real": ["--", "Paris"],
    "articles": ["The Beatles", "the  beatles", "A Hard Day's Night"],
    "punctuation": ["U.S.", "(U.S.A.)", "state-of-the-art"],
    "unicode": ["Café Müller", "ＡＢＣ", "naïve\u00a0résumé", "Ελληνικά", "東京"],
    "dashes_quotes": ["\u201cHello\u201d \u2014 world", "it\u2019s"],
    "repeated": ["new new york", "new york"],
    "unanswerable_1": [],
    "unanswerable_2": [],
    "unanswerable_3": [],
}
EDGE_PREDICTIONS = {
    "empty_only": "an the",
    "empty_and_real": "",
    "articles": "Beatles",
    "punctuation": "U.S",
    "unicode": "cafe müller",
    "dashes_quotes": "Hello \u2014 World",
    "repeated": "new new new york",
    "unanswerable_1": "",
    "unanswerable_2": "the",
    "unanswerable_3": "Paris",
}


def test_edge_cases_score_as_the_scripts_do():
    gold_answers = [a for answers in EDGE_GOLD.values() for a in answers] + [""]
    for gold in gold_answers:
        for pred in [*EDGE_PREDICTIONS.values(), *gold_answers, "  ", "\t."]:
            assert metrics.compute_exact(gold, pred) == official.v2_compute_exact(gold, pred)
            assert metrics.compute_f1(gold, pred) == official.v2_compute_f1(gold, pred)
            assert metrics.f1_score(pred, gold) == official.v1_f1_score(pred, gold)
            assert metrics.exact_match_score(pred, gold) == official.v1_exact_match_score(
                pred, gold)
    # Ties at the thresholds: several questions share the value a threshold takes.
    na_probs = {qid: [0.5, -1.0, 0.5, 2.0, 0.5][i % 5] for i, qid in enumerate(EDGE_GOLD)}
    _check_both_scripts(EDGE_GOLD, EDGE_PREDICTIONS, na_probs, (1.0, 0.5, -1.0, 0.0, 2.0))


def test_ties_at_the_threshold_follow_the_files_order():
    """find_best_thresh visits tied questions in the order of the no-answer file: the best
    total can be reached inside a tie, so the order changes best_*; ours follows it."""
    gold = {"good": ["x"], "bad": []}
    preds = {"good": "x", "bad": "y"}
    first = metrics.evaluate_v2(gold, preds, {"good": 0.5, "bad": 0.5})
    assert first["best_exact"] == 100.0 and first["best_exact_thresh"] == 0.5
    second = metrics.evaluate_v2(gold, preds, {"bad": 0.5, "good": 0.5})
    assert second["best_exact"] == 50.0 and second["best_exact_thresh"] == 0.0
    for na_probs in ({"good": 0.5, "bad": 0.5}, {"bad": 0.5, "good": 0.5}):
        for t in (0.5, 0.4999, 1.0):  # at 0.5 nothing is forced: the script's ">"
            _same(metrics.evaluate_v2(gold, preds, na_probs, t),
                  official.evaluate_v2(official.dataset_of(gold), preds, na_probs, t))


WORDS = ["the", "a", "an", "The", "An", "cat", "Cat", "sat", "mat", "café", "Café", "1990",
         "U.S.", ".", ",", "!", "--", "'s", "naïve", "東京", "ＡＢＣ", "x-y", "\u2014", "(b)"]


def test_random_answers_score_as_the_scripts_do():
    rng = random.Random(84)
    for trial in range(150):
        gold, preds, na_probs = {}, {}, {}
        for i in range(rng.randint(1, 12)):
            qid = f"t{trial}q{i}"
            gold[qid] = ([" ".join(rng.choices(WORDS, k=rng.randint(1, 4)))
                          for _ in range(rng.randint(1, 3))] if rng.random() < 0.6 else [])
            preds[qid] = ("" if rng.random() < 0.2
                          else " ".join(rng.choices(WORDS, k=rng.randint(1, 5))))
            na_probs[qid] = rng.choice([-2.0, -0.5, 0.0, 0.0, 0.5, 1.0, 3.0])
        _check_both_scripts(gold, preds, na_probs, (1.0, 0.0, -0.5, 0.5))


# --- real dev questions ----------------------------------------------------------------------

@pytest.fixture
def dev_sample():
    path = require_shared_data("squad", "dev-v2.0.sample.json")
    return path, json.loads(path.read_text())["data"]


def _adversarial_predictions(dataset, seed):
    """Per question: a gold or plausible answer as is, re-cased and with an article and
    punctuation, cut, widened, "", an answer that normalises to "", or other context."""
    rng = random.Random(seed)
    preds, na_probs = {}, {}
    for article in dataset:
        for p in article["paragraphs"]:
            context_words = p["context"].split()
            for qa in p["qas"]:
                answers = [a["text"] for a in qa["answers"] or qa.get("plausible_answers", [])]
                answer = rng.choice(answers) if answers else "nothing"
                start = rng.randrange(len(context_words))
                preds[qa["id"]] = rng.choice([
                    answer, f"The {answer.upper()}.", answer.split()[0],
                    f"{answer} {rng.choice(context_words)}", "", "an the", ".",
                    " ".join(context_words[start:start + rng.randint(1, 5)])])
                na_probs[qa["id"]] = round(rng.gauss(0.0, 2.0), 1)  # many ties
    return preds, na_probs


def test_real_dev_questions_score_as_the_scripts_do(dev_sample):
    _, dataset = dev_sample
    gold = _gold(dataset)
    assert sum(not a for a in gold.values()) == 35  # both kinds of question
    v1_dataset = _v1_dataset(dataset)
    v1_gold = _gold(v1_dataset)
    for seed in range(10):
        preds, na_probs = _adversarial_predictions(dataset, seed)
        _same(metrics.evaluate_v2(gold, preds), official.evaluate_v2(dataset, preds))
        for t in (1.0, 0.0, -1.0, 2.0, na_probs[next(iter(na_probs))]):
            _same(metrics.evaluate_v2(gold, preds, na_probs, t),
                  official.evaluate_v2(dataset, preds, na_probs, t))
        assert metrics.evaluate_v1(v1_gold, preds) == official.evaluate_v1(v1_dataset, preds)


# --- a SquadTask's numbers against the scripts on its files ----------------------------------

def _squad_task(tok, train_file, dev_file, version="2.0", **squad_fields):
    c = squad_config.get_config("v2" if version == "2.0" else "v1")
    c.squad.train_file, c.squad.dev_file = str(train_file), str(dev_file)
    c.squad.doc_stride, c.squad.max_query_len = 64, 24
    c.data.max_train_examples = 1  # only the dev set is scored
    for k, v in squad_fields.items():
        c.squad[k] = v
    return squad.task.SquadTask(c, tok, 128)


def _fake_run_eval(task, seed):
    """run_eval with random logits, peaked at the gold answer in some windows (so that
    some answers are right, some partly, some null), the same for every call."""
    features, rng = task.dev_features, np.random.default_rng(seed)
    width = max(len(s) for s in features.sequences)
    start = rng.normal(0.0, 1.0, (len(features), width)).astype(np.float32)
    end = rng.normal(0.0, 1.0, (len(features), width)).astype(np.float32)
    # The null logit: one per question (its null score is the smallest over its windows).
    start[:, 0] = end[:, 0] = rng.normal(4.0, 1.5, len(task.dev_examples))[
        features.example_index]
    for f, e in enumerate(features.example_index):
        example = task.dev_examples[e]
        if not example.answers or rng.random() < 0.3:
            continue
        begin = example.answer_starts[0]
        span = squad.examples.answer_token_span(features.offsets[e], begin,
                                                begin + len(example.answers[0]))
        w0, c0 = features.window_start[f], features.context_start[f]
        if span and w0 <= span[0] and span[1] < w0 + features.window_len[f]:
            start[f, c0 + span[0] - w0] += 6.0
            end[f, c0 + span[1] - w0 + int(rng.random() < 0.3)] += 6.0  # sometimes wider

    def run_eval(sequences, targets):
        assert len(sequences) == len(features) and targets == {}
        return [(np.arange(len(features)), {"start": start, "end": end})]

    return run_eval


def test_v2_reports_what_the_script_gives_on_the_written_files(dev_sample, tiny_tokenizer,
                                                               tmp_path):
    path, dataset = dev_sample
    task = _squad_task(tiny_tokenizer, path, path)
    run_eval = _fake_run_eval(task, 0)

    def run(t):
        """The reported numbers at threshold t, held against the script on the files."""
        task.config.squad.null_score_diff_threshold = t
        reported = task.score(run_eval)
        written = tmp_path / f"t{t}"
        files = task.write_outputs(written, run_eval)
        assert sorted(files) == sorted(str(written / "predictions" / n) for n in (
            "predictions.json", "null_odds.json", "nbest_predictions.json"))
        preds = json.loads((written / "predictions" / "predictions.json").read_text())
        na_probs = json.loads((written / "predictions" / "null_odds.json").read_text())
        # The documented command: --na-prob-thresh set to the run's threshold.
        _same(reported, official.evaluate_v2(dataset, preds, na_probs, t))
        assert f"--na-prob-thresh {t!r}" in task.official_command(written)
        if t == 0.0:  # the default threshold: the script's default 1.0 gives the same
            _same(reported, official.evaluate_v2(dataset, preds, na_probs))
            assert 0 < sum(p == "" for p in preds.values()) < len(preds)
            assert reported["HasAns_exact"] > 0.0 and reported["NoAns_exact"] > 0.0
        return reported

    odds = sorted(task._predict(run_eval).null_odds.values())
    for t in (0.0, -1.0, 2.0, odds[len(odds) // 2]):  # the last: a question exactly at it
        run(t)
    # The search runs on the written predictions. At a threshold above every question's
    # odds each best span is written (what the search used to read at any threshold);
    # below the best threshold found there, what the run answered "" the search cannot
    # answer, so it finds less.
    everything = run(odds[-1] + 1.0)
    below = run(everything["best_f1_thresh"] - 1.0)
    assert below["best_f1"] < everything["best_f1"]


def test_v1_reports_what_the_script_gives_and_answers_empty_without_a_span(
        dev_sample, tiny_tokenizer, tmp_path):
    path, dataset = dev_sample
    v1_file = tmp_path / "dev-v1.1.json"
    v1_dataset = _v1_dataset(dataset)
    v1_file.write_text(json.dumps({"version": "1.1", "data": v1_dataset}))
    # One start and one end candidate per window, spans of at most 4 tokens: some answers
    # right, some questions without a surviving span.
    task = _squad_task(tiny_tokenizer, path, v1_file, "1.1", n_best=1, max_answer_len=4)
    run_eval = _fake_run_eval(task, 1)
    reported = task.score(run_eval)
    files = task.write_outputs(tmp_path / "run", run_eval)
    assert sorted(files) == sorted(str(tmp_path / "run" / "predictions" / n)
                                   for n in ("predictions.json", "nbest_predictions.json"))
    preds = json.loads((tmp_path / "run" / "predictions" / "predictions.json").read_text())
    nbest = json.loads((tmp_path / "run" / "predictions" / "nbest_predictions.json").read_text())
    assert reported == official.evaluate_v1(v1_dataset, preds)
    assert 0.0 < reported["exact_match"] < 100.0
    unanswered = [qid for qid, text in preds.items() if not text]
    assert unanswered and len(unanswered) < len(preds)
    assert all(nbest[qid] == [] for qid in unanswered)  # no span survived: "", no n-best
    assert task.official_command(tmp_path).startswith(f"python evaluate-v1.1.py {v1_file} ")


def test_v1_refuses_a_dev_file_with_unanswerable_questions(dev_sample, tiny_tokenizer):
    path, _ = dev_sample
    with pytest.raises(squad.examples.SquadDataError, match="has no answer.*version=2.0"):
        _squad_task(tiny_tokenizer, path, path, "1.1")
