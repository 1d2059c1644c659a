"""Text: the SentencePiece and Hugging Face tokenizers, chat templates, stop strings."""
