from layertap.store.reader import Store

__all__ = ["Store"]
