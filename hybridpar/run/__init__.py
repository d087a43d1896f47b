"""A training run: the step loop (train.py), the one pre-flight check (preflight.py) and the launch
around torch's elastic agent (launcher.py)."""
