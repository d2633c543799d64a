"""One-shot pruning (magnitude, Wanda, SparseGPT), layer by layer. (``elsa_ds.oneshot(...)``, the Python API's one-shot
entry point, is this package made callable by ``elsa_ds/__init__.py``.)"""
