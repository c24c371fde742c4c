"""Checkpoint families HARTS loads and saves (Hugging Face transformers directories)."""
