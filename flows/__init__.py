"""Prefect flows composing the tasks; deployment entrypoints live here."""

from flows.embed import embed_flow

__all__ = ["embed_flow"]
