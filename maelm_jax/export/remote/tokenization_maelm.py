"""The tokenizer of a maelm_jax run in Hugging Face transformers: its SentencePiece model,
with the ids and special tokens of maelm_jax's fine-tuning.

Written by maelm_jax's export beside the weights; it imports only transformers and
sentencepiece. Each text is encoded by SentencePiece whole (the ``<mask>`` literal is
one of its pieces), so the ids are exactly maelm_jax's: ``<s> A </s>`` for one text,
``<s> A </s></s> B </s>`` for a pair, truncated longest-first from the right. A lone
"▁" piece before ``<mask>`` is dropped, as maelm_jax's fill-mask does: ``<mask>`` then
stands for a word-initial piece, as in pretraining.

``MaelmTokenizerFast``, what AutoTokenizer loads, gives the same ids from the export's
``tokenizer.json`` (the SentencePiece model converted by maelm_jax's export), with offset
mappings; ``MaelmTokenizer`` is the slow one, from ``tokenizer.model``.
"""

import os
import shutil

import sentencepiece as spm
from transformers import PreTrainedTokenizer, PreTrainedTokenizerFast

SPACE = "\u2581"


class MaelmTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                 cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                 **kwargs):
        self.vocab_file = vocab_file
        # Loaded before the base class's __init__, which looks the special tokens up.
        self.sp_model = spm.SentencePieceProcessor()
        self.sp_model.Load(vocab_file)
        super().__init__(bos_token=bos_token, eos_token=eos_token, sep_token=sep_token,
                         cls_token=cls_token, unk_token=unk_token, pad_token=pad_token,
                         mask_token=mask_token, **kwargs)

    @property
    def vocab_size(self):
        return self.sp_model.get_piece_size()

    def get_vocab(self):
        return {self.sp_model.id_to_piece(i): i for i in range(self.vocab_size)}

    def tokenize(self, text, **kwargs):
        """The text's pieces, SentencePiece on the whole text (special-token literals
        other than <mask> are text, as in maelm_jax)."""
        pieces = self.sp_model.encode(text, out_type=str)
        mask = str(self.mask_token)
        return [p for i, p in enumerate(pieces)
                if not (p == SPACE and i + 1 < len(pieces) and pieces[i + 1] == mask)]

    def _tokenize(self, text, **kwargs):
        return self.tokenize(text)

    def _convert_token_to_id(self, token):
        return self.sp_model.piece_to_id(token)

    def _convert_id_to_token(self, index):
        return self.sp_model.id_to_piece(int(index))

    def convert_tokens_to_string(self, tokens):
        return self.sp_model.decode_pieces(list(tokens))

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        bos, eos = [self.bos_token_id], [self.eos_token_id]
        if token_ids_1 is None:
            return bos + list(token_ids_0) + eos
        return bos + list(token_ids_0) + eos + eos + list(token_ids_1) + eos

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None,
                                already_has_special_tokens=False):
        if already_has_special_tokens:
            special = {self.bos_token_id, self.eos_token_id, self.pad_token_id}
            return [int(t in special) for t in token_ids_0]
        if token_ids_1 is None:
            return [1] + [0] * len(token_ids_0) + [1]
        return [1] + [0] * len(token_ids_0) + [1, 1] + [0] * len(token_ids_1) + [1]

    def create_token_type_ids_from_sequences(self, token_ids_0, token_ids_1=None):
        return [0] * len(self.build_inputs_with_special_tokens(token_ids_0, token_ids_1))

    def save_vocabulary(self, save_directory, filename_prefix=None):
        name = (filename_prefix + "-" if filename_prefix else "") + "tokenizer.model"
        path = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(path):
            shutil.copyfile(self.vocab_file, path)
        return (path,)


class MaelmTokenizerFast(PreTrainedTokenizerFast):
    """The same ids from tokenizer.json, the export's conversion of the SentencePiece
    model (maelm_jax/export/fast_tokenizer.py), with offset mappings."""

    vocab_files_names = {"vocab_file": "tokenizer.model", "tokenizer_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]
    slow_tokenizer_class = MaelmTokenizer
