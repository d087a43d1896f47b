"""The Python API: a config, then training on 4 local processes (tp=2 x pp=2, 1F1B).

.venv/bin/python examples/train_api.py
"""

from hybridpar import Config, launch

if __name__ == "__main__":
    cfg = Config()  # embedded default corpus and model
    cfg.parallel.tp, cfg.parallel.pp = 2, 2
    cfg.parallel.schedule = "1f1b"
    cfg.train.steps, cfg.train.val_every = 60, 20
    cfg.run_dir = "runs/api-example"
    summary = launch(cfg)  # validates, then starts the workers via torch's elastic agent
    print(f"loss {summary['losses'][0]:.3f} -> {summary['losses'][-1]:.3f}; digest {summary['params_digest'][:16]}")
