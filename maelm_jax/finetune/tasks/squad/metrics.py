"""The official SQuAD evaluation scripts, function for function: ``evaluate-v1.1.py`` for
SQuAD 1.1 and ``evaluate-v2.0.py`` for SQuAD 2.0. A run is scored by its version's script,
so that the script run on the run's files gives the run's numbers.

Both compare answers after one normalisation (lowercase, punctuation removed, the articles
a / an / the removed, whitespace collapsed), score a question by the maximum over its gold
answers and print percentages. They differ where an answer normalises to "" (a lone
article, a lone punctuation mark) and where a prediction is missing:

- v1.1 keeps every gold answer. A prediction that normalises to "" matches a gold "." or
  "the" exactly (exact_match 1) but shares no token with it (F1 0: F1 is 0 whenever no
  token is common, "" against "" included). A question without a prediction counts, with
  0. It reports ``exact_match`` and ``f1``.
- v2.0 drops the gold answers that normalise to ""; a question left with none (an
  unanswerable one, whose ``answers`` are empty, or one whose golds are all "." or "the")
  has "" as its only gold answer, which "" matches with exact 1 and F1 1. So on golds
  that are all "." a prediction "" or "an the" scores exact 1 in both scripts and F1 1
  in v2.0, 0 in v1.1; on golds ['a', 'An!', 'The'] the prediction 'a' scores F1 1 in
  v2.0 and 0 in v1.1. A question without a prediction leaves every total (the script
  then fails on HasAns / NoAns; here a one-line error). It reports ``exact``, ``f1``,
  ``total`` and the same for the answerable (``HasAns_*``) and unanswerable
  (``NoAns_*``) questions.

With no-answer probabilities (v2.0's ``--na-prob-file``, qid -> a score, higher = more
likely unanswerable; ours are null score minus best span score), a question scoring above
``--na-prob-thresh`` (default 1.0) is counted as answered "": 1 if its ``answers`` are
empty, else 0 (whatever its gold answers normalise to), and ``best_exact`` / ``best_f1``
are the best totals over all thresholds, on the predictions as given, at
``best_*_thresh`` (`find_best_thresh`, questions visited in order of probability, ties in
the file's order).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (both scripts)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


# --- evaluate-v1.1.py ----------------------------------------------------------------------

def f1_score(prediction: str, ground_truth: str) -> float:
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:  # also when either side normalises to ""
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def metric_max_over_ground_truths(metric_fn, prediction: str,
                                  ground_truths: Sequence[str]) -> float:
    return max(metric_fn(prediction, ground_truth) for ground_truth in ground_truths)


def evaluate_v1(gold: Mapping[str, Sequence[str]], predictions: Mapping[str, str]) -> dict:
    """The v1.1 script's output: {"exact_match", "f1"}.

    gold: qid -> gold answer texts (each question has at least one; ValueError naming the
    first that has none: the script would fail on it); predictions: qid -> text (a missing
    question scores 0).
    """
    exact_match = f1 = 0.0
    for qid, ground_truths in gold.items():
        if not ground_truths:
            raise ValueError(f"SQuAD 1.1 evaluation: question {qid!r} has no gold answer "
                             "(an unanswerable question: score it as SQuAD 2.0)")
        if qid not in predictions:
            continue  # the script warns "will receive score 0"; it counts in the total
        prediction = predictions[qid]
        exact_match += metric_max_over_ground_truths(exact_match_score, prediction,
                                                     ground_truths)
        f1 += metric_max_over_ground_truths(f1_score, prediction, ground_truths)
    total = len(gold)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


# --- evaluate-v2.0.py ----------------------------------------------------------------------

def get_tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def compute_exact(a_gold: str, a_pred: str) -> int:
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    gold_toks, pred_toks = get_tokens(a_gold), get_tokens(a_pred)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        # If either is no-answer, then F1 is 1 if they agree, 0 otherwise.
        return float(gold_toks == pred_toks)
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def get_raw_scores(gold: Mapping[str, Sequence[str]],
                   preds: Mapping[str, str]) -> tuple[dict, dict]:
    """Per-question EM and F1, max over the gold answers. gold: qid -> answer texts."""
    exact_scores, f1_scores = {}, {}
    for qid, answers in gold.items():
        gold_answers = [a for a in answers if normalize_answer(a)]
        if not gold_answers:
            gold_answers = [""]  # unanswerable: the only correct answer is ""
        if qid not in preds:
            continue  # the script reports it missing; it counts in neither total
        a_pred = preds[qid]
        exact_scores[qid] = max(compute_exact(a, a_pred) for a in gold_answers)
        f1_scores[qid] = max(compute_f1(a, a_pred) for a in gold_answers)
    return exact_scores, f1_scores


def apply_no_ans_threshold(scores: dict, na_probs: Mapping[str, float],
                           qid_to_has_ans: Mapping[str, bool], na_prob_thresh: float) -> dict:
    new_scores = {}
    for qid, s in scores.items():
        pred_na = na_probs[qid] > na_prob_thresh
        new_scores[qid] = float(not qid_to_has_ans[qid]) if pred_na else s
    return new_scores


def make_eval_dict(exact_scores: dict, f1_scores: dict,
                   qid_list: Sequence[str] | None = None) -> dict:
    if not qid_list:
        total = len(exact_scores)
        return {"exact": 100.0 * sum(exact_scores.values()) / total,
                "f1": 100.0 * sum(f1_scores.values()) / total, "total": total}
    total = len(qid_list)
    return {"exact": 100.0 * sum(exact_scores[k] for k in qid_list) / total,
            "f1": 100.0 * sum(f1_scores[k] for k in qid_list) / total, "total": total}


def find_best_thresh(preds: Mapping[str, str], scores: dict, na_probs: Mapping[str, float],
                     qid_to_has_ans: Mapping[str, bool]) -> tuple[float, float]:
    """Sweeps the no-answer threshold up through the questions sorted by na_prob: from
    "every question answered ''" (the unanswerable ones right), each question in turn
    answered as predicted; the best running total and the na_prob where it was reached."""
    num_no_ans = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    cur_score = best_score = num_no_ans
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur_score += diff
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def find_all_best_thresh(main_eval: dict, preds: Mapping[str, str], exact_raw: dict,
                         f1_raw: dict, na_probs: Mapping[str, float],
                         qid_to_has_ans: Mapping[str, bool]) -> None:
    main_eval["best_exact"], main_eval["best_exact_thresh"] = find_best_thresh(
        preds, exact_raw, na_probs, qid_to_has_ans)
    main_eval["best_f1"], main_eval["best_f1_thresh"] = find_best_thresh(
        preds, f1_raw, na_probs, qid_to_has_ans)


def _require_every_question(gold: Mapping[str, Sequence[str]], given: Mapping,
                            what: str) -> None:
    missing = next((qid for qid in gold if qid not in given), None)
    if missing is not None:
        raise ValueError(f"SQuAD 2.0 evaluation: no {what} for question {missing!r} (the "
                         "official script fails on a missing one)")


def evaluate_v2(gold: Mapping[str, Sequence[str]], preds: Mapping[str, str],
                na_probs: Mapping[str, float] | None = None,
                na_prob_thresh: float = 1.0) -> dict:
    """The v2.0 script's output dict (exact, f1, total, HasAns_*, NoAns_*, best_*).

    gold: qid -> gold answer texts ([] for an unanswerable question); preds: qid -> text,
    one for every question (ValueError naming the first missing: the script fails on it);
    na_probs: qid -> no-answer score (the script's --na-prob-file; without it all 0 and no
    best_* entries), one for every question; na_prob_thresh: the script's --na-prob-thresh.
    """
    _require_every_question(gold, preds, "prediction")
    if na_probs is not None:
        _require_every_question(gold, na_probs, "no-answer probability")
    qid_to_has_ans = {qid: bool(answers) for qid, answers in gold.items()}
    has_ans_qids = [k for k, v in qid_to_has_ans.items() if v]
    no_ans_qids = [k for k, v in qid_to_has_ans.items() if not v]
    given_na_probs = na_probs is not None
    na_probs = na_probs if given_na_probs else {k: 0.0 for k in preds}
    exact_raw, f1_raw = get_raw_scores(gold, preds)
    exact_thresh = apply_no_ans_threshold(exact_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    f1_thresh = apply_no_ans_threshold(f1_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    out = make_eval_dict(exact_thresh, f1_thresh)
    for prefix, qids in (("HasAns", has_ans_qids), ("NoAns", no_ans_qids)):
        if qids:
            for k, v in make_eval_dict(exact_thresh, f1_thresh, qid_list=qids).items():
                out[f"{prefix}_{k}"] = v
    if given_na_probs:
        find_all_best_thresh(out, preds, exact_raw, f1_raw, na_probs, qid_to_has_ans)
    return out
