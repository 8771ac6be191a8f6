"""The models a run may start from (its init_from): a workdir of ours, one of its
checkpoints, or a Hugging Face RoBERTa/BERT directory, each read once into a Source."""
