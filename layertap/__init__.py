from layertap.store import Store

__all__ = ["Store"]
