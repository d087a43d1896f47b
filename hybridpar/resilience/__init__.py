"""Fault tolerance: sharded, atomically committed checkpoints and resume (`checkpoint.py`)."""
