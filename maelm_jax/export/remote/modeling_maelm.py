"""A maelm_jax encoder in PyTorch, for Hugging Face transformers (trust_remote_code=True).

Written by maelm_jax's export beside the weights; it imports only torch and transformers
and computes what maelm_jax's Flax modules compute (maelm_jax/models/): token and
absolute position embeddings and a LayerNorm, a T5-style relative position bias shared by
all layers (T5's bucketing or the official MAE-LM code's), post-LN or pre-LN Transformer
layers with the exact GELU, LayerNorm epsilon 1e-5. Stock transformers classes cannot
express that bias, pre-LN with a final LayerNorm, or MAE-LM's decoder, hence this file.

* `MaelmModel` (AutoModel): the encoder's final hidden states.
* `MaelmForMaskedLM`: for an MLM run the encoder reads `<mask>` and its LM head predicts
  there; for MAE-LM and 3ML runs the `<mask>` positions are left out of the encoder, as in
  pretraining, and the decoder predicts them (the other positions' logits come from the
  decoder too for a self decoder, from the encoder's outputs for a cross decoder).
* `MaelmForSequenceClassification`: RoBERTa's head on `<s>` (or the mean of the tokens).
* `MaelmForQuestionAnswering`: start and end logits; with `qa_context_only`, only the
  context of `<s> question </s></s> context </s>` and `<s>` (no answer) can be chosen.
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
)

from .configuration_maelm import MaelmConfig

try:  # transformers 5: initialisers that leave loaded weights alone
    from transformers import initialization as init
except ImportError:  # transformers 4
    from torch.nn import init

def _return_dict(config, return_dict):
    """Whether to return an output class (transformers' default) or a tuple."""
    return return_dict if return_dict is not None else getattr(config, "return_dict", True)


# The logit of a padded or excluded span position (finite: start + end cannot overflow).
_MASKED_SPAN_LOGIT = -1e9


def t5_relative_bucket(relative, num_buckets, max_distance):
    """T5's bidirectional bucketing of relative = key position - query position."""
    half = num_buckets // 2
    bucket = (relative > 0).long() * half
    distance = relative.abs()
    max_exact = half // 2
    ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(
        max_distance / max_exact)
    large = (max_exact + (ratio * (half - max_exact)).long()).clamp(max=half - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


def maelm_relative_bucket(relative, num_buckets, max_distance):
    """The official MAE-LM code's bucketing: signed, symmetric, shifted to be non-negative."""
    half = num_buckets // 2
    distance = relative.abs()
    max_exact = half // 2
    ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(
        (max_distance - 1) / max_exact)
    large = (max_exact + torch.ceil(ratio * (half - 1 - max_exact)).long()).clamp(max=half - 1)
    signed = torch.where(distance < max_exact, distance, large) * torch.sign(relative)
    return signed + half - 1


BUCKET_FNS = {"t5": t5_relative_bucket, "maelm": maelm_relative_bucket}


class RelativePositionBias(nn.Module):
    def __init__(self, num_buckets, max_distance, num_heads, bucket_fn):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bucket_fn = BUCKET_FNS[bucket_fn]
        self.rel_embedding = nn.Embedding(num_buckets, num_heads)

    def forward(self, q_pos, k_pos):
        """q_pos [B, n], k_pos [B, m] -> [B, heads, n, m]."""
        buckets = self.bucket_fn(k_pos[:, None, :] - q_pos[:, :, None], self.num_buckets,
                                 self.max_distance)
        return self.rel_embedding(buckets).permute(0, 3, 1, 2)


class Attention(nn.Module):
    def __init__(self, d_model, num_heads, dropout):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, x):
        return x.view(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, context, bias=None, mask=None):
        """x [B, n, D] attends to context [B, m, D]; bias [B or 1, heads, n, m]; mask bool
        [B, m] or [B, n, m], True where a key may be attended to."""
        q, k, v = self._heads(self.query(x)), self._heads(self.key(context)), self._heads(
            self.value(context))
        logits = (q @ k.transpose(-1, -2)).float() / math.sqrt(self.head_dim)
        if bias is not None:
            logits = logits + bias
        if mask is not None:
            mask = mask[:, None, None, :] if mask.dim() == 2 else mask[:, None]
            logits = logits.masked_fill(~mask, torch.finfo(torch.float32).min)
        probs = self.dropout(torch.softmax(logits, dim=-1)).to(v.dtype)
        out = (probs @ v).transpose(1, 2).reshape(*x.shape[:2], -1)
        return self.out(out)


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, activation_dropout):
        super().__init__()
        self.wi, self.wo = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(activation_dropout)

    def forward(self, x):
        return self.wo(self.dropout(F.gelu(self.wi(x))))


class Layer(nn.Module):
    """Self-attention and MLP, post-LN or pre-LN (maelm_jax's TransformerLayer)."""

    def __init__(self, d_model, num_heads, d_ff, pre_ln, config):
        super().__init__()
        self.pre_ln = pre_ln
        self.attention = Attention(d_model, num_heads, config.attention_probs_dropout_prob)
        self.mlp = FeedForward(d_model, d_ff, config.activation_dropout)
        self.ln_attention = nn.LayerNorm(d_model, eps=config.layer_norm_eps)
        self.ln_mlp = nn.LayerNorm(d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, bias, mask):
        if self.pre_ln:
            h = self.ln_attention(x)
            x = x + self.dropout(self.attention(h, h, bias, mask))
            return x + self.dropout(self.mlp(self.ln_mlp(x)))
        x = self.ln_attention(x + self.dropout(self.attention(x, x, bias, mask)))
        return self.ln_mlp(x + self.dropout(self.mlp(x)))


class Stack(nn.Module):
    """num_layers Layers; a pre-LN stack ends with a final LayerNorm."""

    def __init__(self, num_layers, d_model, num_heads, d_ff, pre_ln, config):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d_model, num_heads, d_ff, pre_ln, config)
                                    for _ in range(num_layers))
        self.ln_final = nn.LayerNorm(d_model, eps=config.layer_norm_eps) if pre_ln else None

    def forward(self, x, bias, mask, collect=None):
        """collect: a list that gets each layer's output (pre-LN: the last after ln_final)."""
        for i, layer in enumerate(self.layers):
            x = layer(x, bias, mask)
            if self.ln_final is not None and i == len(self.layers) - 1:
                x = self.ln_final(x)
            if collect is not None:
                collect.append(x)
        return x


class MaelmPreTrainedModel(PreTrainedModel):
    config_class = MaelmConfig
    base_model_prefix = "encoder"
    _no_split_modules = ["Layer", "CrossLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, LmHead):
            init.zeros_(module.bias)
        elif isinstance(module, CrossDecoder):
            init.normal_(module.mask_embedding, mean=0.0, std=std)


class MaelmModel(MaelmPreTrainedModel):
    """The encoder: what maelm_jax keeps for fine-tuning."""

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, d)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, d)
        self.ln_embed = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.relative_bias = (RelativePositionBias(
            config.rel_pos_buckets, config.rel_pos_max_distance, config.num_attention_heads,
            config.rel_pos_bucket_fn) if config.rel_pos_buckets else None)
        self.stack = Stack(config.num_hidden_layers, d, config.num_attention_heads,
                           config.intermediate_size, config.pre_ln, config)
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def encode(self, input_ids, positions, key_mask, collect=None):
        """input_ids [B, n], positions [B or 1, n] (original positions), key_mask [B, n] bool
        or None -> hidden states [B, n, D]."""
        x = self.ln_embed(self.word_embeddings(input_ids) + self.position_embeddings(positions))
        if collect is not None:
            collect.append(x)
        x = self.dropout(x)
        bias = self.relative_bias(positions, positions) if self.relative_bias else None
        return self.stack(x, bias, key_mask, collect)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                output_hidden_states=None, return_dict=None, **kwargs):
        """input_ids [B, n]; attention_mask [B, n] (1 = token, 0 = padding); position_ids
        [B, n] (default 0..n-1). Returns the last hidden states [B, n, D] (and, with
        output_hidden_states, the embedding output and every layer's)."""
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        return_dict = _return_dict(self.config, return_dict)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        key_mask = None if attention_mask is None else attention_mask.bool()
        collect = [] if output_hidden_states else None
        hidden = self.encode(input_ids, position_ids, key_mask, collect)
        states = tuple(collect) if collect is not None else None
        if not return_dict:
            return (hidden,) + ((states,) if states is not None else ())
        return BaseModelOutput(last_hidden_state=hidden, hidden_states=states)


class LmHead(nn.Module):
    """dense -> GELU -> LayerNorm -> the word embeddings (tied) + bias."""

    def __init__(self, d_in, config):
        super().__init__()
        self.dense = nn.Linear(d_in, config.hidden_size)
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x, word_embeddings):
        x = self.ln(F.gelu(self.dense(x)))
        return x.float() @ word_embeddings.float().T + self.bias


class _Decoder(nn.Module):
    """What both decoders have: the projection from the encoder's width (3ML), their own
    position table (or the encoder's), the embedding LayerNorm and dropout, an optional
    relative position bias; `settings` are config.pretraining_decoder's fields,
    `layer_config` what its layers read (its own dropout rates)."""

    def __init__(self, config):
        super().__init__()
        d = self.settings = dict(config.pretraining_decoder)
        self.layer_config = SimpleNamespace(
            layer_norm_eps=config.layer_norm_eps, hidden_dropout_prob=d["dropout"],
            attention_probs_dropout_prob=d["attention_dropout"],
            activation_dropout=d["activation_dropout"])
        width, self.share_positions = d["hidden_size"], d["share_positions"]
        self.projection = (nn.Linear(config.hidden_size, width)
                           if width != config.hidden_size else None)
        self.position_embeddings = (None if self.share_positions else
                                    nn.Embedding(d["max_position_embeddings"], width))
        self.ln_embed = nn.LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(d["dropout"])
        self.relative_bias = (RelativePositionBias(
            d["rel_pos_buckets"], d["rel_pos_max_distance"], d["num_attention_heads"],
            config.rel_pos_bucket_fn) if d["rel_pos_buckets"] else None)

    def position_table(self, encoder_positions):
        """[positions, D_dec]: the decoder's own table, or the encoder's when shared."""
        return encoder_positions if self.share_positions else self.position_embeddings.weight


class SelfDecoder(_Decoder):
    """MAE-LM's and 3ML_self's decoder: the encoder's outputs at their positions, the [MASK]
    embedding elsewhere, its own positions, a Transformer stack over the whole length."""

    def __init__(self, config):
        super().__init__(config)
        d = self.settings
        self.stack = Stack(d["num_layers"], d["hidden_size"], d["num_attention_heads"],
                           d["intermediate_size"], d["pre_ln"], self.layer_config)

    def forward(self, hidden, enc_index, enc_valid, mask_embedding, key_mask, encoder_positions):
        """hidden [B, n_enc, D] at positions enc_index [B, n_enc] (enc_valid: real ones);
        key_mask [B, n] (the text's tokens). Returns [B, n, D_dec]."""
        B, n = key_mask.shape
        if self.projection is not None:
            hidden, mask_embedding = self.projection(hidden), self.projection(mask_embedding)
        x = mask_embedding.to(hidden.dtype).expand(B, n + 1, -1).clone()
        # Invalid slots write to a spare last row, dropped below.
        index = torch.where(enc_valid, enc_index, torch.full_like(enc_index, n))
        x = x.scatter(1, index[..., None].expand(-1, -1, x.shape[-1]), hidden)[:, :n]
        x = self.dropout(self.ln_embed(x + self.position_table(encoder_positions)[:n][None]))
        positions = torch.arange(n, device=x.device)[None]
        bias = self.relative_bias(positions, positions) if self.relative_bias else None
        return self.stack(x, bias, key_mask)


class CrossLayer(nn.Module):
    """Self-attention among the [MASK] queries (bidirectional, causal or none),
    cross-attention to the encoder's outputs, MLP."""

    def __init__(self, d_model, num_heads, d_ff, pre_ln, self_attention, config):
        super().__init__()
        self.pre_ln, self.self_attention_kind = pre_ln, self_attention
        eps = config.layer_norm_eps
        if self_attention != "none":
            self.self_attention = Attention(d_model, num_heads,
                                            config.attention_probs_dropout_prob)
            self.ln_self_attention = nn.LayerNorm(d_model, eps=eps)
        self.cross_attention = Attention(d_model, num_heads, config.attention_probs_dropout_prob)
        self.ln_cross_attention = nn.LayerNorm(d_model, eps=eps)
        self.mlp = FeedForward(d_model, d_ff, config.activation_dropout)
        self.ln_mlp = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, context, self_bias, cross_bias, self_mask, cross_mask):
        drop = self.dropout
        if self.self_attention_kind != "none":
            if self.pre_ln:
                h = self.ln_self_attention(x)
                x = x + drop(self.self_attention(h, h, self_bias, self_mask))
            else:
                x = self.ln_self_attention(x + drop(self.self_attention(x, x, self_bias,
                                                                        self_mask)))
        if self.pre_ln:
            x = x + drop(self.cross_attention(self.ln_cross_attention(x), context, cross_bias,
                                              cross_mask))
            return x + drop(self.mlp(self.ln_mlp(x)))
        x = self.ln_cross_attention(x + drop(self.cross_attention(x, context, cross_bias,
                                                                  cross_mask)))
        return self.ln_mlp(x + drop(self.mlp(x)))


CROSS_SELF_ATTENTION = {"cross": "bidirectional", "causal_cross": "causal",
                        "cross_only": "none"}


class CrossDecoder(_Decoder):
    """3ML_cross (and MAE-LM Table 2's causal_cross, cross_only): a learned [MASK] vector at
    each removed position attends to the others and to the encoder's outputs."""

    def __init__(self, config):
        super().__init__(config)
        d, width = self.settings, self.settings["hidden_size"]
        self.kind = CROSS_SELF_ATTENTION[d["kind"]]
        self.mask_embedding = nn.Parameter(torch.zeros(width))
        self.layers = nn.ModuleList(
            CrossLayer(width, d["num_attention_heads"], d["intermediate_size"], d["pre_ln"],
                       self.kind, self.layer_config) for _ in range(d["num_layers"]))
        self.ln_final = nn.LayerNorm(width, eps=config.layer_norm_eps) if d["pre_ln"] else None

    def forward(self, hidden, enc_index, enc_valid, dec_index, dec_valid, encoder_positions):
        """hidden [B, n_enc, D] at enc_index; the removed [MASK]s at dec_index [B, n_de]
        (ascending; dec_valid: real ones). Returns [B, n_de, D_dec]."""
        context = self.projection(hidden) if self.projection is not None else hidden
        x = self.dropout(self.ln_embed(self.mask_embedding
                                       + self.position_table(encoder_positions)[dec_index]))
        self_bias = cross_bias = None
        if self.relative_bias is not None:
            self_bias = self.relative_bias(dec_index, dec_index)
            cross_bias = self.relative_bias(dec_index, enc_index)
        self_mask = dec_valid
        if self.kind == "causal":
            n = dec_index.shape[1]
            causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device))
            self_mask = causal[None] & dec_valid[:, None, :]
        for layer in self.layers:
            x = layer(x, context, self_bias, cross_bias, self_mask, enc_valid)
        return self.ln_final(x) if self.ln_final is not None else x


def _first(valid, count):
    """Indices [B, count] of each row's True entries, ascending, then its others; and
    whether each is True."""
    order = torch.argsort((~valid).int(), dim=1, stable=True)[:, :count]
    return order, valid.gather(1, order)


class MaelmForMaskedLM(MaelmPreTrainedModel):
    """The pretrained network: the encoder and, for MAE-LM and 3ML, the decoder."""

    def __init__(self, config):
        super().__init__(config)
        self.encoder = MaelmModel(config)
        self.decoder = self.decoder_to_encoder = None
        d_in = config.hidden_size
        if config.objective != "mlm":
            d = config.pretraining_decoder
            if d["kind"] == "self":
                self.decoder = SelfDecoder(config)
                d_in = d["hidden_size"]
            else:
                self.decoder = CrossDecoder(config)
                if d["hidden_size"] != config.hidden_size:
                    self.decoder_to_encoder = nn.Linear(d["hidden_size"], config.hidden_size)
        self.lm_head = LmHead(d_in, config)
        self.post_init()

    def _logits(self, x):
        return self.lm_head(x, self.encoder.word_embeddings.weight)

    def forward(self, input_ids=None, attention_mask=None, labels=None, return_dict=None,
                **kwargs):
        """input_ids [B, n] with `<mask>` where a piece is to be predicted; attention_mask
        [B, n]; labels [B, n] (-100: not scored). Returns logits [B, n, vocab] (float32)."""
        return_dict = _return_dict(self.config, return_dict)
        token_mask = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                      else attention_mask.bool())
        if self.decoder is None:
            hidden = self.encoder.encode(
                input_ids, torch.arange(input_ids.shape[1], device=input_ids.device)[None],
                token_mask)
            logits = self._logits(hidden)
        else:
            logits = self._decoded_logits(input_ids, token_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1),
                                   ignore_index=-100)
        if not return_dict:
            return (logits,) if loss is None else (loss, logits)
        return MaskedLMOutput(loss=loss, logits=logits)

    def _decoded_logits(self, input_ids, token_mask):
        """MAE-LM and 3ML: the `<mask>` positions are left out of the encoder."""
        B, n = input_ids.shape
        removed = (input_ids == self.config.mask_token_id) & token_mask
        kept = token_mask & ~removed
        enc_index, enc_valid = _first(kept, int(kept.sum(1).max()))
        positions = enc_index
        if self.config.misaligned_positions:  # MAE-LM Table 2: consecutive encoder positions
            positions = torch.arange(enc_index.shape[1], device=input_ids.device)[None]
        hidden = self.encoder.encode(input_ids.gather(1, enc_index), positions, enc_valid)
        shared = self.encoder.position_embeddings.weight
        if isinstance(self.decoder, SelfDecoder):
            mask_embedding = self.encoder.word_embeddings.weight[self.config.mask_token_id]
            return self._logits(self.decoder(hidden, enc_index, enc_valid, mask_embedding,
                                             token_mask, shared))
        # Cross decoders: the removed [MASK]s from the decoder, the rest from the encoder.
        logits = hidden.new_zeros(B, n + 1, self.config.vocab_size, dtype=torch.float32)
        parts = [(self._logits(hidden), enc_index, enc_valid)]
        n_de = int(removed.sum(1).max())
        if n_de:
            dec_index, dec_valid = _first(removed, n_de)
            dec = self.decoder(hidden, enc_index, enc_valid, dec_index, dec_valid, shared)
            if self.decoder_to_encoder is not None:
                dec = self.decoder_to_encoder(dec)
            parts.append((self._logits(dec), dec_index, dec_valid))
        for part, index, valid in parts:
            index = torch.where(valid, index, torch.full_like(index, n))
            logits = logits.scatter(1, index[..., None].expand(-1, -1, part.shape[-1]), part)
        return logits[:, :n]


class ClassificationHead(nn.Module):
    """RoBERTa's: dropout -> dense -> tanh -> dropout -> out."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.num_labels)
        self.dropout = nn.Dropout(config.classifier_dropout)

    def forward(self, x):
        return self.out(self.dropout(torch.tanh(self.dense(self.dropout(x)))))


class MaelmForSequenceClassification(MaelmPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = MaelmModel(config)
        self.classifier = ClassificationHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, labels=None, return_dict=None,
                **kwargs):
        """input_ids, attention_mask [B, n] -> logits [B, num_labels] (one: regression)."""
        return_dict = _return_dict(self.config, return_dict)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.encoder(input_ids, attention_mask, return_dict=True).last_hidden_state
        if self.config.pooling == "mean":
            weights = attention_mask.to(hidden.dtype)[..., None]
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        else:
            pooled = hidden[:, 0]
        logits = self.classifier(pooled).float()
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits[:, 0], labels.float())
            else:
                loss = F.cross_entropy(logits, labels.view(-1))
        if not return_dict:
            return (logits,) if loss is None else (loss, logits)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class MaelmForQuestionAnswering(MaelmPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.encoder = MaelmModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, start_positions=None,
                end_positions=None, return_dict=None, **kwargs):
        """Start and end logits [B, n] over `<s> question </s></s> context </s>` windows."""
        return_dict = _return_dict(self.config, return_dict)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.encoder(input_ids, attention_mask, return_dict=True).last_hidden_state
        logits = self.qa_outputs(hidden).float()
        allowed = attention_mask.bool()
        if self.config.qa_context_only:
            is_eos = input_ids == self.config.eos_token_id
            allowed = (is_eos.cumsum(1) >= 2) & ~is_eos & allowed
            allowed[:, 0] = True  # <s>: no answer
        start, end = (logits[..., i].masked_fill(~allowed, _MASKED_SPAN_LOGIT) for i in (0, 1))
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = 0.5 * (F.cross_entropy(start, start_positions)
                          + F.cross_entropy(end, end_positions))
        if not return_dict:
            return (start, end) if loss is None else (loss, start, end)
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start, end_logits=end)
