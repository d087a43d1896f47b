"""Memory against the corpus's size (issue 35): the peak resident memory of every process of a
`hybridpar train` of the tiny test model at tp2 x pp2, a few steps, on a token file of 20 MB and on one
of 2 GB (nanoGPT uint16 ids, random below 256, written here), both read in place. The ratio of the
largest rank's peaks (largest file / smallest) is ~1 where memory does not grow with the corpus. RSS
counts the token file's pages a rank has touched (`shared_mb`, file-backed and given back under
pressure); what remains to grow is the shuffled order of the windows, 4 bytes per `--seq-len` tokens.

    .venv/bin/hybridpar bench data [--sizes-mb 20,2048] [--steps 20] [--seq-len 1024] [--dir DIR] [--json FILE]

A size whose file does not fit on the disk of --dir (with 1 GB to spare) is skipped, and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from hybridpar.bench import emit
from hybridpar.config.parse import to_toml
from hybridpar.model.reference import tiny_config

CHUNK = 1 << 24  # ids written per call: memory stays bounded while writing a large file
SPARE = 1 << 30


def write_tokens(path: Path, size_mb: int, seed: int = 0) -> int:
    """A nanoGPT token file of `size_mb` MB: uint16 ids below 256 (the tiny model's vocabulary)."""
    n, rng = size_mb * 2**20 // 2, np.random.default_rng(seed)
    with open(path, "wb") as f:
        for lo in range(0, n, CHUNK):
            rng.integers(0, 256, size=min(CHUNK, n - lo), dtype=np.uint16).astype("<u2").tofile(f)
    return n


def peak_rss(cmd: list[str], env: dict[str, str], poll_s: float = 0.05) -> tuple[int, dict[int, dict[str, int]]]:
    """Run `cmd`; its exit code and, per process of its tree, the peak RSS and file-backed resident bytes
    seen by polling (the OS keeps no high-water mark of another process)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root, peaks = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                mem = p.memory_info()
            except psutil.Error:
                continue
            top = peaks.setdefault(p.pid, {"rss": 0, "shared": 0})
            if mem.rss > top["rss"]:
                top["rss"], top["shared"] = mem.rss, mem.shared
        time.sleep(poll_s)
    _, err = proc.communicate()
    if proc.returncode:
        sys.stderr.write(err.decode(errors="replace")[-2000:])
    peaks.pop(proc.pid, None)  # the launcher: what is measured is the ranks
    return proc.returncode, peaks


def run_size(size_mb: int, a: argparse.Namespace, tmp: Path) -> dict:
    data = tmp / f"tokens-{size_mb}mb.bin"
    tokens = write_tokens(data, size_mb)
    cfg = tiny_config(parallel=dict(tp=2, pp=2))
    cfg.train.steps, cfg.train.seq_len, cfg.train.val_every = a.steps, a.seq_len, 0
    cfg.data.path, cfg.data.max_tokens, cfg.run_dir = str(data), None, str(tmp / f"run-{size_mb}")
    toml = tmp / f"run-{size_mb}.toml"
    toml.write_text(to_toml(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    exe = str(Path(sys.executable).with_name("hybridpar"))
    rc, peaks = peak_rss([exe, "train", "--config", str(toml)], env)
    data.unlink()
    ranks = sorted(peaks.values(), key=lambda m: -m["rss"])[:4]
    metrics = Path(cfg.run_dir) / "metrics.jsonl"  # (absent or short where the run failed: no times then)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    return {
        "size_mb": size_mb,
        "tokens": tokens,
        "exit_code": rc,
        "peak_rss_mb": [round(m["rss"] / 2**20, 1) for m in ranks],
        "shared_mb": [round(m["shared"] / 2**20, 1) for m in ranks],
        # The first step maps the file and faults in its first windows: where a corpus's size would show.
        "first_step_s": round(times[0], 4) if times else None,
        "median_step_s": round(statistics.median(times[1:]), 4) if len(times) > 1 else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="20,2048", help="token file sizes in MB, comma-separated")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="where the token files are written (default: the temp dir)")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes_mb.split(",")]
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="hybridpar-bench-data-", dir=a.dir) as tmp:
        for size in sizes:
            free = shutil.disk_usage(tmp).free
            if size * 2**20 + SPARE > free:
                skipped.append(f"{size} MB: {free // 2**20} MB free on {tmp}, need {size} MB and 1 GB to spare")
                continue
            rows.append(run_size(size, a, Path(tmp)))
    done = [r for r in rows if r["exit_code"] == 0 and r["peak_rss_mb"]]
    out = {
        "bench": "data",
        "model": f"tiny test model, tp2 x pp2, {a.steps} steps of seq_len {a.seq_len}",
        "runs": rows,
        "skipped": skipped,
        "ratio_largest_rank_peak": (
            round(done[-1]["peak_rss_mb"][0] / done[0]["peak_rss_mb"][0], 3) if len(done) > 1 else None
        ),
        "ratio_first_step": (
            round(done[-1]["first_step_s"] / done[0]["first_step_s"], 3)
            if len(done) > 1 and done[0]["first_step_s"] and done[-1]["first_step_s"]
            else None
        ),
        "load_avg_1m": os.getloadavg()[0],
    }
    emit(out, a.json)
    return 0 if len(done) == len(rows) else 1
