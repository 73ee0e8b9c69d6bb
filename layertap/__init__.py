"""layertap: per-layer hidden-state embeddings of decoder LLMs. `Store` reads what runs have stored."""

from layertap.store.reader import Store

__all__ = ["Store"]
