"""Shared-prefix generative search-ranking scorer."""
