"""Text into tokens: opening a corpus, text or a token file read in place (sources.py), its sample
order (corpus.py), tokenizers (tokenizer.py), token files and their index (tokenfile.py), the documents
a corpus is read as (inputs.py: text files, JSON Lines, gzipped) and preparing token files (prepare.py)."""
