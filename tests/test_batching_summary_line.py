"""The end-of-run microbatching line says what its figures measure: the pipeline's run per step (the
optimizer step excluded) and the mean of each step's rate, which disagree with each other after one slow
step (train.compile's first). Pure."""

from __future__ import annotations

from hybridpar.trainer.final import summary_line


def test_the_line_names_the_pipeline_and_the_mean_of_rates() -> None:
    # 4 steps of 256 tokens: one of 26.4 s (compiling), three of 0.25 s
    times = [26.4, 0.25, 0.25, 0.25]
    stats = {
        "policy": "fixed",
        "current_split": [2, 2, 2, 2],
        "mean_latency_s": sum(times) / 4,
        "mean_throughput": sum(256 / t for t in times) / 4,
    }
    line = summary_line(stats, 0)
    assert line == (
        "microbatching: fixed, split [2, 2, 2, 2]; the pipeline (optimizer step excluded): mean 6.787 s/step, "
        "mean of each step's 770 tok/s"
    )
    assert summary_line({**stats, "mean_throughput": None}, 1) == (
        "microbatching: fixed, split [2, 2, 2, 2]; 1 step(s) redone after running out of memory"
    )
