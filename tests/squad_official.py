"""The official SQuAD evaluation scripts' scoring, written for the tests from their public
specification (evaluate-v1.1.py and evaluate-v2.0.py), apart from the package's own
(maelm_jax/finetune/tasks/squad/metrics.py), which the tests hold against it.

Both read what the scripts read: the dataset file's "data" (articles -> paragraphs ->
qas with "id" and "answers": [{"text"}]) and the prediction file's qid -> text; v2.0 also
the --na-prob-file's qid -> score and --na-prob-thresh. The scripts' plotting and
precision-recall options are left out: they change no reported number.
"""

import collections
import re
import string


def normalize_answer(s):
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = s.lower()
    exclude = set(string.punctuation)
    s = "".join(ch for ch in s if ch not in exclude)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _questions(dataset):
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


# --- evaluate-v1.1.py ----------------------------------------------------------------------

def v1_f1_score(prediction, ground_truth):
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def v1_exact_match_score(prediction, ground_truth):
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def v1_metric_max_over_ground_truths(metric_fn, prediction, ground_truths):
    return max([metric_fn(prediction, ground_truth) for ground_truth in ground_truths])


def evaluate_v1(dataset, predictions):
    """evaluate-v1.1.py's printed dict."""
    f1 = exact_match = total = 0
    for qa in _questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            continue  # "Unanswered question ... will receive score 0."
        ground_truths = [x["text"] for x in qa["answers"]]
        prediction = predictions[qa["id"]]
        exact_match += v1_metric_max_over_ground_truths(v1_exact_match_score, prediction,
                                                        ground_truths)
        f1 += v1_metric_max_over_ground_truths(v1_f1_score, prediction, ground_truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


# --- evaluate-v2.0.py ----------------------------------------------------------------------

def v2_get_tokens(s):
    if not s:
        return []
    return normalize_answer(s).split()


def v2_compute_exact(a_gold, a_pred):
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def v2_compute_f1(a_gold, a_pred):
    gold_toks = v2_get_tokens(a_gold)
    pred_toks = v2_get_tokens(a_pred)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(pred_toks)
    recall = 1.0 * num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def v2_get_raw_scores(dataset, preds):
    exact_scores, f1_scores = {}, {}
    for qa in _questions(dataset):
        qid = qa["id"]
        gold_answers = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])]
        if not gold_answers:
            gold_answers = [""]
        if qid not in preds:
            continue  # "Missing prediction for ..."
        a_pred = preds[qid]
        exact_scores[qid] = max(v2_compute_exact(a, a_pred) for a in gold_answers)
        f1_scores[qid] = max(v2_compute_f1(a, a_pred) for a in gold_answers)
    return exact_scores, f1_scores


def v2_apply_no_ans_threshold(scores, na_probs, qid_to_has_ans, na_prob_thresh):
    new_scores = {}
    for qid, s in scores.items():
        if na_probs[qid] > na_prob_thresh:
            new_scores[qid] = float(not qid_to_has_ans[qid])
        else:
            new_scores[qid] = s
    return new_scores


def v2_make_eval_dict(exact_scores, f1_scores, qid_list=None):
    if not qid_list:
        total = len(exact_scores)
        return collections.OrderedDict([
            ("exact", 100.0 * sum(exact_scores.values()) / total),
            ("f1", 100.0 * sum(f1_scores.values()) / total),
            ("total", total)])
    total = len(qid_list)
    return collections.OrderedDict([
        ("exact", 100.0 * sum(exact_scores[k] for k in qid_list) / total),
        ("f1", 100.0 * sum(f1_scores[k] for k in qid_list) / total),
        ("total", total)])


def v2_find_best_thresh(preds, scores, na_probs, qid_to_has_ans):
    num_no_ans = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    cur_score = num_no_ans
    best_score = cur_score
    best_thresh = 0.0
    qid_list = sorted(na_probs, key=lambda k: na_probs[k])
    for qid in qid_list:
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        elif preds[qid]:
            diff = -1
        else:
            diff = 0
        cur_score += diff
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def evaluate_v2(dataset, preds, na_probs=None, na_prob_thresh=1.0):
    """evaluate-v2.0.py's printed dict: `na_probs` is its --na-prob-file's content (None:
    not given), `na_prob_thresh` its --na-prob-thresh."""
    given = na_probs is not None
    if not given:
        na_probs = {k: 0.0 for k in preds}
    qid_to_has_ans = {qa["id"]: bool(qa["answers"]) for qa in _questions(dataset)}
    has_ans_qids = [k for k, v in qid_to_has_ans.items() if v]
    no_ans_qids = [k for k, v in qid_to_has_ans.items() if not v]
    exact_raw, f1_raw = v2_get_raw_scores(dataset, preds)
    exact_thresh = v2_apply_no_ans_threshold(exact_raw, na_probs, qid_to_has_ans,
                                             na_prob_thresh)
    f1_thresh = v2_apply_no_ans_threshold(f1_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    out = v2_make_eval_dict(exact_thresh, f1_thresh)
    for prefix, qids in (("HasAns", has_ans_qids), ("NoAns", no_ans_qids)):
        if qids:
            for k, v in v2_make_eval_dict(exact_thresh, f1_thresh, qid_list=qids).items():
                out[f"{prefix}_{k}"] = v
    if given:
        out["best_exact"], out["best_exact_thresh"] = v2_find_best_thresh(
            preds, exact_raw, na_probs, qid_to_has_ans)
        out["best_f1"], out["best_f1_thresh"] = v2_find_best_thresh(
            preds, f1_raw, na_probs, qid_to_has_ans)
    return dict(out)


def dataset_of(gold):
    """A dataset's "data" holding `gold` (qid -> answer texts) as one paragraph's questions."""
    qas = [{"id": qid, "question": "?", "answers": [{"text": t, "answer_start": 0}
                                                    for t in answers]}
           for qid, answers in gold.items()]
    return [{"title": "t", "paragraphs": [{"context": "", "qas": qas}]}]
