"""The vocabulary and the corruption the models and the data share: the tokenizer and the
masking."""
