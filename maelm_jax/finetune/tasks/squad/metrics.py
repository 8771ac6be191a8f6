"""The official SQuAD 2.0 evaluation (``evaluate-v2.0.py``), function for function.

Answers are compared after normalisation: lowercase, punctuation removed, the articles
a / an / the removed, whitespace collapsed. A question's score is the maximum over its
gold answers; an unanswerable question's only gold answer is "" (so predicting "" scores
1 on it, anything else 0, and "" scores 0 on an answerable question). With no-answer
scores (``na_probs``: higher = more likely unanswerable, e.g. the null score minus the
best span score), ``best_exact`` / ``best_f1`` are the scores at the best threshold and
``*_thresh`` that threshold. Every number is a percentage, as the script prints.
SQuAD 1.1 (every question answerable) gives the same ``exact`` / ``f1``.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


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
    """Sweeps the no-answer threshold over the questions sorted by na_prob."""
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


def evaluate(gold: Mapping[str, Sequence[str]], preds: Mapping[str, str],
             na_probs: Mapping[str, float] | None = None,
             na_prob_thresh: float = 1.0) -> dict:
    """The script's output dict (exact, f1, total, HasAns_*, NoAns_*, best_*).

    gold: qid -> gold answer texts ([] for an unanswerable question); preds: qid -> text;
    na_probs: qid -> no-answer score (the script's --na-prob-file; without it all 0 and no
    best_* entries); na_prob_thresh: the script's --na-prob-thresh (default 1.0).
    """
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
        qids = [k for k in qids if k in exact_thresh]  # the script would crash on a missing one
        if qids:
            for k, v in make_eval_dict(exact_thresh, f1_thresh, qid_list=qids).items():
                out[f"{prefix}_{k}"] = v
    if given_na_probs:
        out["best_exact"], out["best_exact_thresh"] = find_best_thresh(
            preds, exact_raw, na_probs, qid_to_has_ans)
        out["best_f1"], out["best_f1_thresh"] = find_best_thresh(
            preds, f1_raw, na_probs, qid_to_has_ans)
    return out
