"""Export of a trained run to a directory Hugging Face transformers loads (mode "export")."""
