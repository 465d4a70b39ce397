"""Tokenizers: loading, caching and building them."""
