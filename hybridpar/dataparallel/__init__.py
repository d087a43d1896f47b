"""Data parallelism: gradient reductions across the mesh (grads.py), the ZeRO-1 sharded optimizer
(zero.py) and its fp32 masters of bf16 working copies (copies.py)."""
