"""Continued pretraining: the corpus and its reader, phased training, the held-out codebase loss, SFT."""
