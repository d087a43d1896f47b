"""Data parallelism: gradient reductions across the mesh (grads.py) and the ZeRO-1 sharded optimizer
(zero.py)."""
