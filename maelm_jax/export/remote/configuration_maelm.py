"""The configuration of a maelm_jax encoder in Hugging Face transformers.

Written by maelm_jax's export (python main.py --config=configs/export.py ...) beside the
weights; it imports only transformers. The fields are the trained model's architecture
in transformers' names where they have one, and maelm_jax's where they do not (the
relative position bias, pre-LN, the pretraining decoder).
"""

from transformers import PretrainedConfig


class MaelmConfig(PretrainedConfig):
    """A maelm_jax encoder, and the decoder and head that pretraining or fine-tuning gave it.

    objective: "mlm" (the encoder reads [MASK]) or "maelm" (MAE-LM, 3ML_self and 3ML_cross:
    [MASK]s are left out of the encoder; `pretraining_decoder` describes the network that
    predicts them).
    pretraining_decoder: None, or a dict of the decoder's fields: kind ("self", "cross",
    "causal_cross", "cross_only"), num_layers, hidden_size, num_attention_heads,
    intermediate_size, pre_ln, max_position_embeddings (the pretraining length),
    rel_pos_buckets, rel_pos_max_distance, share_positions and its dropout rates. (Not
    "decoder": transformers reads a field of that name as an encoder-decoder's sub-config.)
    """

    model_type = "maelm_jax"

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
        pre_ln=False,
        rel_pos_buckets=32,
        rel_pos_max_distance=128,
        rel_pos_bucket_fn="t5",
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        activation_dropout=0.0,
        initializer_range=0.02,
        objective="mlm",
        misaligned_positions=False,
        pretraining_decoder=None,
        classifier_dropout=0.1,
        pooling="first",
        qa_context_only=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        mask_token_id=4,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.pre_ln = pre_ln
        self.rel_pos_buckets = rel_pos_buckets
        self.rel_pos_max_distance = rel_pos_max_distance
        self.rel_pos_bucket_fn = rel_pos_bucket_fn
        self.layer_norm_eps = layer_norm_eps
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.activation_dropout = activation_dropout
        self.initializer_range = initializer_range
        self.objective = objective
        self.misaligned_positions = misaligned_positions
        self.pretraining_decoder = pretraining_decoder
        self.classifier_dropout = classifier_dropout
        self.pooling = pooling
        self.qa_context_only = qa_context_only
        self.mask_token_id = mask_token_id
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, **kwargs)
