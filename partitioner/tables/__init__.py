"""Embedding tables on disk: built in chunks, probed, range-checked, checksummed, and their deltas."""
