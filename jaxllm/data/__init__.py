"""Data: GPT-2 tokenizer, token files, batch sources, associative recall, translation pairs."""
