"""Text into tokens: the corpus and its sample order (corpus.py), tokenizers (tokenizer.py) and prepared
token files (prepare.py)."""
