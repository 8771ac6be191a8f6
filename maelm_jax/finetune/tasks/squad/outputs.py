"""From start / end logits to answer text (BERT's and RoBERTa's SQuAD post-processing).

For each question, over all of its windows: the n-best start and end positions inside
the window's context, kept when end >= start, the span has at most max_answer_len tokens
and the window is the start token's max-context window. A span's score is
start + end logit; its text is the context between the first token's first character
and the last token's last character. The null ("no answer") score is start + end logit
at position 0, the smallest over the windows. SQuAD 2.0 answers "" when
null score - best span score > null_score_diff_threshold; that difference is also the
question's no-answer score (the official v2.0 script's --na-prob-file, and its
best-threshold search). A question without any valid span (every candidate too long,
ending before its start or outside its max-context window) is answered "" in both
versions: SQuAD 1.1 has no null answer to fall back on, and "" is what the official
scripts score as no answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from maelm_jax.finetune.tasks.squad import examples

# The no-answer score of a question without any valid span (it can only answer "").
NO_SPAN_NULL_ODDS = 1e30


@dataclasses.dataclass
class Predictions:
    text: dict[str, str]  # qid -> predicted answer ("" = no answer)
    null_odds: dict[str, float]  # qid -> null score - best span score
    nbest: dict[str, list[dict]]  # qid -> [{"text", "score", "probability", ...}], best first


def _softmax(scores: Sequence[float]) -> np.ndarray:
    scores = np.asarray(scores, np.float64)
    e = np.exp(scores - scores.max())
    return e / e.sum()


def postprocess(examples: Sequence[examples.SquadExample], features: examples.SquadFeatures,
                start_logits: Sequence[np.ndarray], end_logits: Sequence[np.ndarray],
                n_best: int = 20, max_answer_len: int = 30, version_2: bool = True,
                null_score_diff_threshold: float = 0.0) -> Predictions:
    """start_logits / end_logits: [F] arrays, feature f's of length >= len(sequences[f])."""
    by_example: dict[int, list[int]] = {}
    for f, e in enumerate(features.example_index):
        by_example.setdefault(int(e), []).append(f)
    out = Predictions({}, {}, {})
    for e, example in enumerate(examples):
        candidates = []  # (score, start logit, end logit, char begin, char end)
        null_score = np.inf
        for f in by_example.get(e, []):
            s, t = np.asarray(start_logits[f]), np.asarray(end_logits[f])
            null_score = min(null_score, float(s[0] + t[0]))
            c0, length = int(features.context_start[f]), int(features.window_len[f])
            ctx_s, ctx_e = s[c0:c0 + length], t[c0:c0 + length]
            top_s = np.argsort(-ctx_s, kind="stable")[:n_best]
            top_e = np.argsort(-ctx_e, kind="stable")[:n_best]
            offsets = features.offsets[e]
            w0 = int(features.window_start[f])
            for i in top_s:
                if not features.max_context[f][i]:
                    continue
                for j in top_e:
                    if j < i or j - i + 1 > max_answer_len:
                        continue
                    begin, end = offsets[w0 + i, 0], offsets[w0 + j, 1]
                    candidates.append((float(ctx_s[i] + ctx_e[j]), float(ctx_s[i]),
                                       float(ctx_e[j]), int(begin), int(end)))
        candidates.sort(key=lambda c: -c[0])
        entries, seen = [], set()
        for score, s_logit, e_logit, begin, end in candidates:
            text = example.context[begin:end].strip()
            if not text or text in seen:
                continue
            seen.add(text)
            entries.append({"text": text, "score": score, "start_logit": s_logit,
                            "end_logit": e_logit, "char_start": begin, "char_end": end})
            if len(entries) == n_best:
                break
        best = entries[0] if entries else None
        if version_2 and np.isfinite(null_score):
            entries.append({"text": "", "score": null_score, "start_logit": None,
                            "end_logit": None, "char_start": -1, "char_end": -1})
            entries.sort(key=lambda x: -x["score"])
        if entries:
            for entry, p in zip(entries, _softmax([x["score"] for x in entries]), strict=False):
                entry["probability"] = float(p)
        odds = null_score - best["score"] if best and np.isfinite(null_score) else NO_SPAN_NULL_ODDS
        out.null_odds[example.qid] = float(odds)
        answer_null = best is None or (version_2 and odds > null_score_diff_threshold)
        out.text[example.qid] = "" if answer_null else best["text"]
        out.nbest[example.qid] = entries
    return out
