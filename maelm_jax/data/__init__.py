"""Data: corpus sources (built-in, text, JSONL, WikiExtractor, TFDS), packing and loading."""
