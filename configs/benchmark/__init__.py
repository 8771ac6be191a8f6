"""The benchmarks' default configs (benchmarks/): `sized` is what each of them sets."""

from maelm_jax.pretrain import config as pretrain_config


def sized(*, vocab_size: int, seq_len: int, batch_size: int, encoder: tuple[int, int, int, int],
          decoder: tuple[int, int, int, int], dropout: float = 0.1,
          decoder_dropout: float = 0.0):
    """Pretraining defaults at the given sizes. encoder and decoder: (layers, d_model,
    heads, d_ff); dropout and attention dropout: `dropout` in the encoder,
    `decoder_dropout` in MAE-LM's decoder (the paper's 0)."""
    c = pretrain_config.pretrain_defaults()
    c.tokenizer.vocab_size = vocab_size
    c.data.seq_len = seq_len
    c.train.batch_size = batch_size
    m, d = c.model, c.model.decoder
    m.num_layers, m.d_model, m.num_heads, m.d_ff = encoder
    m.dropout = m.attention_dropout = dropout
    d.num_layers, d.d_model, d.num_heads, d.d_ff = decoder
    d.dropout = d.attention_dropout = decoder_dropout
    return c
