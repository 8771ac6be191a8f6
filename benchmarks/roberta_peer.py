"""The Hugging Face peer of the throughput benchmarks (peer_hf.py, gpu_suite.py):
RobertaForMaskedLM's train step at one of our configs, timed as harness.Bench is
(maelm_jax/infra/timer.py).

Needs torch and transformers (pip install -r requirements-bench.txt); imported only by
the benchmarks that time the peer.
"""

from __future__ import annotations

import time

import ml_collections
import numpy as np

from maelm_jax.infra import timer
from maelm_jax.text import tokenizer

SP = tokenizer.SENTENCEPIECE_IDS  # the ids of a SentencePiece model of ours


class PeerBench(timer.Samples):
    """RobertaForMaskedLM's train step, its times recorded as harness.Bench's are
    (timer.Samples).

    `ours` is our MLM's config: the peer takes its encoder's sizes and dropout, its
    vocabulary, length, masking rate and optimiser settings. device "cuda": bf16 autocast,
    SDPA attention, fused AdamW, each step synchronised; `compiled`: under torch.compile.

    `masked_head`: the peer at our step's work. The stock model runs its LM head and a
    float32 cross-entropy at every position (16,384 at BERT-base's 32 x 512), ours only at
    the masked ones (2,464): with masked_head the hidden states are indexed by
    `labels != -100` before the LM head, as MosaicBERT does, and the loss is the same.
    Eager only: the masked count changes every step, which torch.compile would specialise on.
    """

    def __init__(self, ours: ml_collections.ConfigDict, tokens: np.ndarray, device: str,
                 compiled: bool, masked_head: bool = False):
        super().__init__()
        import torch
        import transformers

        self.torch, self.device = torch, device
        train, m = ours.train, ours.model
        self.mask_ratio = ours.masking.mask_ratio
        self.clip_norm = train.clip_norm
        self.vocab_size = ours.tokenizer.vocab_size
        start = time.perf_counter()
        torch.manual_seed(0)  # initial weights and every step's masks
        config = transformers.RobertaConfig(
            vocab_size=self.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, intermediate_size=m.d_ff,
            # RoBERTa numbers positions from padding_idx + 1 = 2.
            max_position_embeddings=ours.data.seq_len + 2,
            hidden_dropout_prob=m.dropout, attention_probs_dropout_prob=m.attention_dropout,
            # In the config: transformers 5's model constructors no longer take it.
            **({"attn_implementation": "sdpa"} if device == "cuda" else {}))
        cuda = device == "cuda"
        model = transformers.RobertaForMaskedLM(config).to(device).train()
        self.attention = model.config._attn_implementation
        self.num_params = sum(p.numel() for p in model.parameters())  # tied counted once
        # Our optimiser's hyper-parameters (a constant rate: the schedule costs nothing).
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=train.learning_rate, betas=(train.adam_b1, train.adam_b2),
            eps=train.adam_eps, weight_decay=train.weight_decay,
            **({"fused": True} if cuda else {}))
        self.parameters = list(model.parameters())
        self.model = torch.compile(model) if compiled else model
        self.masked_head = masked_head
        self.name = ("peer (torch.compile)" if compiled else
                     "peer (masked head)" if masked_head else "peer")
        self.tokens = torch.from_numpy(tokens).long().to(device)
        self.build_seconds = time.perf_counter() - start

    def mask(self):
        """DataCollatorForLanguageModeling.torch_mask_tokens, without a tokenizer (the random
        ids hold no special tokens)."""
        torch, ids = self.torch, self.tokens.clone()
        labels = ids.clone()
        full = lambda p: torch.full(ids.shape, p, device=self.device)  # noqa: E731
        masked = torch.bernoulli(full(self.mask_ratio)).bool()
        labels[~masked] = -100
        replaced = torch.bernoulli(full(0.8)).bool() & masked
        ids[replaced] = SP.mask
        randomized = torch.bernoulli(full(0.5)).bool() & masked & ~replaced
        ids[randomized] = torch.randint(self.vocab_size, ids.shape, device=self.device)[randomized]
        return ids, labels

    def loss(self, ids, labels):
        """The mean cross-entropy over the masked positions (labels != -100): the stock
        model's, or with masked_head its LM head run at those positions only."""
        torch = self.torch
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device == "cuda"):
            if not self.masked_head:
                return self.model(input_ids=ids, labels=labels).loss
            hidden = self.model.roberta(input_ids=ids).last_hidden_state
            predicted = labels != -100
            logits = self.model.lm_head(hidden[predicted])
        return torch.nn.functional.cross_entropy(logits.float(), labels[predicted])

    def step_once(self) -> None:
        torch = self.torch
        loss = self.loss(*self.mask())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parameters, self.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.device == "cuda":
            torch.cuda.synchronize()
