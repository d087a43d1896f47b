"""The planner: hardware descriptions, cost and memory models, layout search."""
