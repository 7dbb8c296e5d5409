"""Data pipeline: GPT-2 tokenizer, text -> token files, batch sampling."""
