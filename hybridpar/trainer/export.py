"""The trained model as one piece: gathered from its shards onto rank 0, its digest, and written as a
Hugging Face model directory — a run's `final/`, or any run, checkpoint or step of one through
`hybridpar export SOURCE --out DIR`.

The digest is sha256 over (name, fp32 bytes) of every parameter of the full model in definition order,
so two runs can be compared bit for bit whatever their (tp, pp, dp) layout.

A model directory holds `config.json` and `model.safetensors` (what transformers loads), the
tokenizer's files when the run had one, and `hybridpar.json`: the run id, the step and the params
digest, by which `newest_artefact` tells a final model from an older or newer checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from hybridpar.config import Config, ModelConfig, load_toml
from hybridpar.model.registry import export_hf, full_shapes, param_stages
from hybridpar.model.stage import Stage
from hybridpar.model.tp import full_tensor
from hybridpar.topology.mesh import Topology


def params_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def gather_full_state(
    topo: Topology, stages: dict[int, Stage], parts: Sequence[range], cfg: ModelConfig, stage_ranks: Sequence[int]
) -> dict[str, torch.Tensor] | None:
    """Collective over the whole world (call on every rank): rank 0 gets {name: full cpu fp32 tensor}
    in definition order, other ranks None. Replica dp=0 is the source (replicas are identical).
    `stage_ranks[s]` is the pipeline rank holding stage s (the schedule's placement)."""
    shapes = full_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, s in param_stages(cfg, parts).items():
        owner = topo.dims.moved(0, pp=stage_ranks[s])
        if topo.dp_rank == 0 and s in stages:
            p = stages[s].get_parameter(name)
            full = full_tensor(p, topo.group("tp") if topo.dims.tp > 1 else None)  # collective over tp
            if topo.rank == owner:
                if owner == 0:
                    out[name] = full.detach().float().cpu().clone()
                else:
                    dist.send(full.detach().float().contiguous(), dst=0)
        if topo.rank == 0 and owner != 0:
            buf = torch.empty(shapes[name], dtype=torch.float32, device=topo.device)
            dist.recv(buf, src=owner)
            out[name] = buf.cpu()
    return out if topo.rank == 0 else None


FINAL_DIR, RECORD = "final", "hybridpar.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def write_model_dir(
    state: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, record: dict[str, Any], tokenizer: str | None = None
) -> Path:
    """Write `out` as a Hugging Face model directory (see the module docstring), replacing it atomically:
    it is built beside `out` and renamed into place, so a crash leaves the old directory or the new one."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    export_hf(state, cfg, tmp)
    for name in TOKENIZER_FILES if tokenizer else ():
        if (Path(tokenizer) / name).is_file():
            shutil.copyfile(Path(tokenizer) / name, tmp / name)
    (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    _swap_in(tmp, out)
    return out


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, replacing what was there: a crash leaves the old directory or the new one."""
    old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def check_export_out(out: Path) -> None:
    """`hybridpar export --out` replaces the directory whole, so it must be new, empty, or an earlier export
    (only a model directory's files, with hybridpar.json): never a run directory, a run's final/, a
    checkpoint or anyone's other files, which the replacement would delete. ValueError naming what is there."""
    if (out.parent / "run.json").is_file() and out.name == FINAL_DIR:  # the run writes it, and reads it back
        raise ValueError(f"--out {out} is the final model of the run in {out.parent}: give another directory")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a directory to write the model into")
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return
    others = [n for n in names if n not in {"config.json", "model.safetensors", RECORD, *TOKENIZER_FILES}]
    if others or RECORD not in names:
        shown = ", ".join((others or names)[:5]) + (" …" if len(others or names) > 5 else "")
        raise ValueError(
            f"--out {out} holds files that are not an earlier export ({shown}), which writing the model there "
            f"would delete: give a new or empty directory"
        )


def run_config(run_dir: Path) -> Config | None:
    """The config a run recorded in its `config.toml` (None for a directory without one)."""
    path = Path(run_dir) / "config.toml"
    return Config.from_dict(load_toml(str(path)), record=True) if path.is_file() else None


def _step_of(model_dir: Path) -> int:
    try:
        return int(json.loads((model_dir / RECORD).read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1  # no record of ours: older than any checkpoint


def newest_artefact(run_dir: Path, step: int | None = None) -> Path | None:
    """The newest model a run directory holds: its `final/` or its newest verified checkpoint, whichever
    is of the later step (a run resumed for more steps checkpoints past its old final model). `step`:
    that step's checkpoint (or final model) instead (ValueError naming the steps it holds). None if there
    is none."""
    from hybridpar.resilience.commits import committed, find_latest
    from hybridpar.resilience.rundir import checkpoint_run_id, read_run

    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    ck_root = Path(cfg.checkpoint.dir) if cfg and cfg.checkpoint.dir else run_dir / "checkpoints"
    run = read_run(run_dir)
    run_id = run["run_id"] if run else None
    final = run_dir / FINAL_DIR
    final_step = _step_of(final) if (final / "config.json").is_file() else None
    if step is not None:
        if final_step == step:
            return final
        own = {s: p for s, p in committed(ck_root) if checkpoint_run_id(p) == run_id}
        if step not in own:
            # a set: final/ is usually of the last checkpoint's step too; -1 is a final/ with no step recorded
            held = ", ".join(map(str, sorted({*own, *([final_step] if final_step is not None else [])} - {-1})))
            raise ValueError(
                f"run directory {run_dir} holds no checkpoint of step {step}: "
                + (f"--step takes one of {held}" if held else "it holds no model yet")
            )
        return own[step]
    ck, _ = find_latest(ck_root, run_id)
    ck_step = int(ck.name.split("-")[1]) if ck is not None else None
    if final_step is not None and (ck_step is None or final_step >= ck_step):
        return final
    return ck


def export_source(source: str, out: Path, step: int | None = None) -> Path:
    """`hybridpar export`: write the model of a run directory (its newest artefact, or `step`'s), of a
    checkpoint directory or of a model directory (copied) as a Hugging Face model directory `out`.
    ValueError for what cannot be exported."""
    from hybridpar.resilience.checkpoint import read_full_model
    from hybridpar.resilience.rundir import checkpoint_run_id

    src = Path(source)
    check_export_out(Path(out))
    is_model, is_ckpt = (src / "config.json").is_file(), (src / "trainer_state.json").is_file()
    if step is not None and (is_model or is_ckpt):
        raise ValueError(f"--step {step} picks a checkpoint of a run directory; {source} is one model already")
    if not src.is_dir():
        raise ValueError(f"{source} is not a directory (a run, checkpoint or model directory)")
    if not is_model and not is_ckpt:  # a run directory
        found = newest_artefact(src, step)
        if found is None:
            raise ValueError(f"run directory {source} holds no model (neither final/ nor a committed checkpoint)")
        return export_source(str(found), out)
    if is_model:
        if Path(out).resolve() != src.resolve():
            tmp = Path(out).with_name(f".{Path(out).name}.tmp-{secrets.token_hex(4)}")
            shutil.copytree(src, tmp)
            _swap_in(tmp, Path(out))
        return Path(out)
    try:
        state_json = json.loads((src / "trainer_state.json").read_text(encoding="utf-8"))
        cfg = Config.from_dict(state_json["config"], record=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{src} is not a hybridpar checkpoint (its trainer_state.json: {e})") from None
    state = read_full_model(src, cfg.model)
    digest = params_digest(state.items())
    record = {"run_id": checkpoint_run_id(src), "step": state_json["step"], "params_digest": digest}
    return write_model_dir(state, cfg.model, Path(out), record, cfg.data.tokenizer)
