"""The policy-version store: the source of truth for what the trainer published.

Owns the vocabulary (runs, versions, constraints), the layout on any fsspec URL, the pointer
compare-and-swap, the checkpoint codecs and retention. Imports nothing else of Tether.
"""
