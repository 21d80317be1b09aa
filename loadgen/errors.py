"""The one error type the CLI turns into a clean one-line message (no traceback)."""

from __future__ import annotations

__all__ = ["LoadgenError"]


class LoadgenError(Exception):
    """A run cannot start or go on: unreachable server, unknown model, unusable signature.

    Bad specs (``--arrival``, ``--query-size``, numbers out of range) raise
    ``ValueError`` instead; the CLI reports both the same way.
    """
