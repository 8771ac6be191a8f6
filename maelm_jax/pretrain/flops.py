"""Training FLOPs per optimiser step, as counted in 3ML Appendix D ("Calculation of FLOPs").

The 3ML paper restates Pan et al. (2021) with these simplifications, which we keep so our
numbers can be compared with its tables:

* One multiply-add counts as 2 FLOPs (its footnote 6).
* Biases, activations, LayerNorm, softmax and dropout are neglected (< 1 % of the total),
  and so are the sparse embedding lookups and, in our code, the gathers / scatters that
  move tokens in and out of the encoder.
* Forward + backward = 2 x forward: the leading factor 2 in its eqs. (2)-(4). The
  backward pass of a matmul in fact costs about twice its forward (gradients for both
  the input and the weight), so the usual "6 x parameters x tokens" count is 1.5 x
  ours. The factor is the same for every term, so ratios between objectives do not
  depend on it; absolute GFLOP/s computed from these numbers do.

Names follow the paper: n sequence length, d width, |V| vocabulary, l layers, b batch,
r masking rate (here `num_predicted` = n r = k, an int, as our masking uses exact counts).
Every function takes and returns Python ints; nothing here touches JAX. Each objective
(maelm_jax/pretrain/objectives) picks its formula; pretrain/setup.py's Shape evaluates it
for a config, and `model_flops` rescales it to the count every rate reports.
"""

from __future__ import annotations


def model_flops(paper_flops: int) -> int:
    """FLOPs counted forward + backward = 3 x forward (the model FLOPs of MFU, PaLM's
    Appendix B) from the papers' forward + backward = 2 x forward."""
    return paper_flops * 3 // 2


def msa(n: int, d: int) -> int:
    """phi_MSA(n, d) = 8 n d^2 + 4 n^2 d: one multi-head self-attention layer.

    Q, K, V projections 2 * 3 n d^2, output projection 2 n d^2, attention map Q K^T
    2 n^2 d and the attention-weighted sum 2 n^2 d. (The paper's text lists the output
    projection as 2 n^2 d, a typo: its total, used here, has 2 n d^2.) The head count
    does not enter: heads split d, not the work.
    """
    return 8 * n * d * d + 4 * n * n * d


def mlp(n: int, d: int, d_ff: int) -> int:
    """phi_MLP = 4 n d d_ff: the two dense layers d -> d_ff -> d of the feed-forward block.

    The paper writes 16 n d^2 because it assumes d_ff = 4 d; we keep d_ff free so that
    non-standard decoder shapes are counted right. mlp(n, d, 4 * d) == 16 n d^2.
    """
    return 4 * n * d * d_ff


def block(n: int, d: int, d_ff: int) -> int:
    """phi_BLK = phi_MSA + phi_MLP; with d_ff = 4 d this is the paper's 24 n d^2 + 4 n^2 d."""
    return msa(n, d) + mlp(n, d, d_ff)


def prediction(num_predicted: int, d_in: int, d: int, vocab: int) -> int:
    """The LM head at the predicted positions: dense d_in -> d, then tied projection d -> |V|.

    2 k (d_in d + d |V|) with k = num_predicted = n r. With d_in = d this is the paper's
    phi_Pred(n, r, d, |V|) = 2 n r (d^2 + d |V|); with d_in = d_de, d = d_en it is the
    3ML_self head phi'_Pred = 2 n r (d_de d_en + d_en |V|).
    """
    return 2 * num_predicted * (d_in * d + d * vocab)


def mlm_step_flops(batch_size: int, num_layers: int, seq_len: int, d_model: int,
                   d_ff: int, num_predicted: int, vocab_size: int) -> int:
    """RoBERTa-style MLM, one update, eq. (2) with u = 1:

        2 b (l phi_BLK(n, d) + phi_Pred(n, r, d, |V|))

    The encoder reads all n = seq_len positions; the LM head runs at the k predicted ones.
    """
    per_sequence = (num_layers * block(seq_len, d_model, d_ff)
                    + prediction(num_predicted, d_model, d_model, vocab_size))
    return 2 * batch_size * per_sequence


def maelm_step_flops(batch_size: int, encoder_layers: int, decoder_layers: int,
                     seq_len: int, n_enc: int, d_en: int, d_ff_en: int, d_de: int,
                     d_ff_de: int, num_predicted: int, vocab_size: int) -> int:
    """MAE-LM / 3ML_self, one update, eq. (3) with u = 1:

        2 b (2 n_en d_en d_de + l_en phi_BLK(n_en, d_en) + l_de phi_BLK(n, d_de)
             + phi'_Pred(n, r, d_en, d_de, |V|))

    The encoder reads n_enc = L - (removed [MASK]s) tokens, the decoder all n = seq_len
    positions, the head the k predicted ones (d_de -> d_en -> |V|). The projection term
    is counted only when d_en != d_de: our decoder has no projection otherwise (MAE-LM's
    equal-width decoder), whereas eq. (3) always writes it for 3ML's half-width one.
    """
    projection = 2 * n_enc * d_en * d_de if d_en != d_de else 0
    per_sequence = (projection
                    + encoder_layers * block(n_enc, d_en, d_ff_en)
                    + decoder_layers * block(seq_len, d_de, d_ff_de)
                    + prediction(num_predicted, d_de, d_en, vocab_size))
    return 2 * batch_size * per_sequence


def mca(n_en: int, n_de: int, d_de: int) -> int:
    """phi_MCA(n_en, n_de, d_de) = 4 n_en d_de^2 + 4 n_de d_de^2 + 4 n_en n_de d_de.

    Cross-attention of n_de queries to n_en encoder outputs (already at width d_de): keys
    and values 2 * 2 n_en d_de^2, queries 2 n_de d_de^2, map and weighted sum
    2 * 2 n_en n_de d_de, output projection 2 n_de d_de^2. (The paper lists the output
    projection among the terms of phi'_qkv and phi'_out both, but its total, used here,
    counts it once.)
    """
    return 4 * n_en * d_de * d_de + 4 * n_de * d_de * d_de + 4 * n_en * n_de * d_de


def cross_block(n_en: int, n_de: int, d_de: int, d_ff_de: int,
                self_attention: bool = True) -> int:
    """phi_CBLK = phi_BLK(n_de, d_de) + phi_MCA(n_en, n_de, d_de); with d_ff = 4 d the
    paper's 4 n_en d^2 + 28 n_de d^2 + 4 n_en n_de d + 4 n_de^2 d. Without self-attention
    (MAE-LM's cross-attention-only decoder) the phi_MSA(n_de) term drops. A causal
    self-attention is counted in full, as the dense matmuls compute it."""
    total = block(n_de, d_de, d_ff_de) + mca(n_en, n_de, d_de)
    return total if self_attention else total - msa(n_de, d_de)


def cross_step_flops(batch_size: int, encoder_layers: int, decoder_layers: int,
                     n_enc: int, n_de: int, d_en: int, d_ff_en: int, d_de: int,
                     d_ff_de: int, num_predicted: int, vocab_size: int,
                     self_attention: bool = True) -> int:
    """3ML_cross, one update, eq. (4) with u = 1:

        2 b (2 n_en d_en d_de + l_en phi_BLK(n_en, d_en) + l_de phi_CBLK(n_en, n_de, d_de)
             + phi_Pred(k - n_de predicted from the encoder, d_en, |V|)
             + phi'_Pred(n_de, d_en, d_de, |V|))

    The decoder reads only the n_de removed [MASK]s; the other k - n_de predicted tokens
    (random, unchanged, [MASK]s kept in the encoder) go through the head from the
    encoder's outputs. The printed eq. (4) has a misplaced parenthesis; this is its
    evident reading (both heads inside the 2 b (...)). As in eq. (3), the projection is
    counted only when the widths differ, and then our decoder-side head has one more
    d_de -> d_en map in front of the shared d_en -> d_en dense (2 n_de d_en^2, about 1 %
    of the head), which the paper's phi'_Pred folds into one layer. The paper's speedups
    from these counts: benchmarks/speedup_table.py.
    """
    projection = 2 * n_enc * d_en * d_de if d_en != d_de else 0
    head = (prediction(num_predicted - n_de, d_en, d_en, vocab_size)
            + prediction(n_de, d_de, d_en, vocab_size))
    if d_en != d_de:
        head += 2 * n_de * d_en * d_en
    per_sequence = (projection
                    + encoder_layers * block(n_enc, d_en, d_ff_en)
                    + decoder_layers * cross_block(n_enc, n_de, d_de, d_ff_de, self_attention)
                    + head)
    return 2 * batch_size * per_sequence
