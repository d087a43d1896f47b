"""A model in, a model out: a tiny Llama made by transformers (GQA, Llama 3 rope scaling, untied and tied)
fine-tuned 5 steps at tp2 x pp2 with a trained BPE tokenizer on a prepared uint32 dataset; its final/
loads in transformers with logits equal to ours, and served (tp2 x pp2) its greedy chat completion
through the `openai` client equals transformers' generate on the same chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridpar import cli
from hybridpar.config import Config, parse_args
from hybridpar.model.hf import SafetensorsDir
from hybridpar.model.registry import build_full_model, load_stage_, read_hf_config
from hybridpar.run.preflight import preflight
from hybridpar.topology.spawn import run_ranks

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse("}]


def _train_rank(cfg_d: dict) -> str | None:
    from hybridpar.run.train import train

    return train(Config.from_dict(cfg_d), log=False).digest


def _train_ranks(cfg_ds: list[dict]) -> list[str | None]:
    return [_train_rank(d) for d in cfg_ds]


TIES = [False, True]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[Config, torch.nn.Module, Path]]:
    """One tokenizer and dataset for both models (the same inputs, so made once), and both fine-tunings in
    one 4-rank launch (a launch costs ~5 s of interpreters importing torch before its first step). Each
    model starts from its own Hugging Face directory and trains its own run directory."""
    pytest.importorskip("transformers")
    from test_init_from import llama3_hf

    tmp = tmp_path_factory.mktemp("roundtrip")
    tok, data = tmp / "tok", tmp / "d.bin"
    assert cli.main(["data", "train-tokenizer", "--vocab-size", "512", "--out", str(tok), "--max-bytes", "300000"]) == 0
    assert (
        cli.main(
            [
                "data",
                "prepare",
                "--tokenizer",
                str(tok),
                "--out",
                str(data),
                "--dtype",
                "uint32",
                "--max-bytes",
                "400000",
            ]
        )
        == 0
    )
    out = {}
    for tie in TIES:
        hf_dir, run = tmp / f"hf-{tie}", tmp / f"run-{tie}"
        start = llama3_hf(hf_dir, tie, vocab=512)
        cfg = parse_args(["--model.init_from", str(hf_dir), "--data.path", str(data), "--data.tokenizer", str(tok)])
        t = cfg.train
        t.steps, t.global_batch, t.microbatches, t.seq_len, t.val_every, t.warmup_steps = 5, 4, 2, 32, 0, 0
        cfg.data.max_tokens, cfg.run_dir = 100_000, str(run)  # as max_bytes=400_000 read of uint32 ids
        out[tie] = (preflight(cfg, 4)[0], start, run)
    run_ranks(_train_ranks, 4, [out[tie][0].to_dict() for tie in TIES], timeout_s=240)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("tie", TIES)
def test_hugging_face_in_and_out_with_a_trained_tokenizer(tie: bool, trained: dict) -> None:
    transformers = pytest.importorskip("transformers")
    openai = pytest.importorskip("openai")

    cfg, start, run = trained[tie]
    assert (cfg.model.vocab_size, cfg.model.rope_scaling, cfg.model.kv_heads, cfg.model.tied) == (512, "llama3", 2, tie)

    final = run / "final"
    assert {p.name for p in final.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "hybridpar.json"}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    assert read_hf_config(final).resolved() == {**cfg.model.resolved(), "init_from": None}
    ours = build_full_model(cfg.model, 0).eval()
    load_stage_(ours, SafetensorsDir(final), hf_layout=True)
    ids = torch.tensor([list(range(3, 40)), list(range(100, 137))])
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max() <= 1e-5
        assert (theirs(ids).logits - start(ids).logits).abs().max() > 1e-3  # the 5 steps trained it

    # Served from the run directory: its final/, its tokenizer and chat template, tp2 x pp2.
    from hybridpar.serve.http import serving_in_background
    from hybridpar.serve.main import prepare, tokenizer_for
    from hybridpar.serve.service import Service

    scfg, model_cfg, source = prepare(
        ["--source", str(run), "--tp", "2", "--pp", "2", "--timeout-s", "60", "--served-model-name", "hybridpar"]
    )
    svc = Service(scfg, model_cfg, source, tokenizer=tokenizer_for(scfg, model_cfg, source))
    hf_tok = transformers.AutoTokenizer.from_pretrained(final)
    prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = theirs.generate(**prompt, max_new_tokens=16, do_sample=False, eos_token_id=end, pad_token_id=end)
    new = out[0, prompt["input_ids"].shape[1] :].tolist()
    want = hf_tok.decode([i for i in new if i != end])
    assert len(set(new)) > 3, new  # varied tokens: a stuck decoder would match too easily
    with serving_in_background(svc) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="hybridpar", messages=MESSAGES, max_tokens=16, temperature=0)
        streamed = client.chat.completions.create(
            model="hybridpar", messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert r.choices[0].message.content == want == text
    assert r.usage.prompt_tokens == prompt["input_ids"].shape[1] and r.usage.completion_tokens == len(new)
    assert r.choices[0].finish_reason == ("stop" if new[-1] == end else "length")
