"""layertap: per-layer hidden-state embeddings of decoder LLMs. `Store` reads what runs have stored."""

from layertap.parts.allocators import choose_arrow_pool

choose_arrow_pool()  # before any module imports pyarrow, which reads the choice once

from layertap.store.reader import Store  # noqa: E402

__all__ = ["Store"]
