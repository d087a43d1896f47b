"""Tokenizers: `hybridpar data train-tokenizer` and `data prepare` (uint16 / uint32 token files with
their description), the pre-flight checks between data, tokenizer and model (each bad input one line,
exit 2, no worker started), and serving text through the tokenizer: /v1/completions and
/v1/chat/completions (the `openai` client included) over a stand-in replica pool."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from hybridpar import cli
from hybridpar.config import ModelConfig
from hybridpar.data.prepare import documents
from hybridpar.data.sources import open_corpus
from hybridpar.data.tokenizer import StreamDecoder, Tokenizer
from hybridpar.serve.config import ServeConfig

CORPUS_BYTES = "300000"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok"
    assert (
        cli.main(["data", "train-tokenizer", "--vocab-size", "320", "--out", str(out), "--max-bytes", CORPUS_BYTES])
        == 0
    )
    return out


def _prepare(tok: Path, out: Path, *extra: str) -> dict:
    assert (
        cli.main(["data", "prepare", "--tokenizer", str(tok), "--out", str(out), "--max-bytes", CORPUS_BYTES, *extra])
        == 0
    )
    return json.loads(out.with_suffix(".json").read_text())


@pytest.mark.parametrize("dtype", ["auto", "uint32"])
def test_prepare_writes_the_tokenizers_ids_and_describes_them(tok_dir: Path, dtype: str, tmp_path: Path) -> None:
    tok = Tokenizer(tok_dir)
    assert tok.vocab_size == 320 and tok.chat_template and tok.special("eos_token") == "<|im_end|>"
    meta = _prepare(tok_dir, tmp_path / "d.bin", "--dtype", dtype)
    want_dtype = "uint16" if dtype == "auto" else "uint32"
    assert (meta["dtype"], meta["vocab_size"], meta["tokenizer_sha256"]) == (want_dtype, 320, tok.sha256)
    docs = list(documents(None, int(CORPUS_BYTES)))
    eos = tok.token_id("<|im_end|>")  # the tokenizer's own eos_token closes each document
    want = [i for d in docs for i in tok.encode(d) + [eos]]
    assert (meta["eos_id"], meta["eos_token"]) == (eos, "<|im_end|>")
    assert meta["tokens"] == len(want) == (tmp_path / "d.bin").stat().st_size // (2 if dtype == "auto" else 4)
    assert open_corpus(str(tmp_path / "d.bin")).tokens.tolist() == want
    bounds = np.fromfile(tmp_path / "d.idx", dtype="<u8")  # document i is ids[bounds[i]:bounds[i + 1]]
    assert meta["documents"] == len(docs) == len(bounds) - 1 and bounds[0] == 0 and bounds[-1] == len(want)
    assert bounds[1] == len(tok.encode(docs[0])) + 1 and np.all(np.diff(bounds) > 0)


def test_trained_tokenizer_loads_in_transformers_with_the_same_ids(tok_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
    text = "def f(x):\n    return x ** 2  # é, 🙂\n"
    ours = Tokenizer(tok_dir)
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert ours.decode(ours.encode(text)) == text
    dec, pieces = StreamDecoder(ours), []
    for i in ours.encode(text):
        pieces.append(dec.feed(i))
    assert "".join(pieces) + dec.flush() == text and "\ufffd" not in "".join(pieces)
    messages = [{"role": "user", "content": "hi"}]
    from hybridpar.serve.chat import ChatTemplate

    assert ChatTemplate(ours.chat_template).render(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    theirs.save_pretrained(tmp_path / "resaved")  # transformers 5 keeps the template in chat_template.jinja
    assert Tokenizer(tmp_path / "resaved").chat_template == ours.chat_template


@pytest.fixture
def no_launch(monkeypatch):
    import torch.distributed.run as tdr

    def boom(*a, **k):
        raise AssertionError("a worker was launched for bad input")

    monkeypatch.setattr(tdr, "run", boom)


def _bad(tok_dir: Path, tmp: Path, kind: str) -> tuple[list[str], str]:
    """(training flags, what the one error line must say) for one bad combination."""
    data = tmp / "d.bin"
    meta = _prepare(tok_dir, data, "--dtype", "uint32")
    base = ["--data.path", str(data), "--data.tokenizer", str(tok_dir), "--model.vocab_size", "320"]
    if kind == "dtype":
        data.with_suffix(".json").write_text(json.dumps({**meta, "dtype": "uint16"}))
        return base, f"{data} holds {4 * meta['tokens']} bytes, but {data.with_suffix('.json')} describes"
    if kind == "vocab":
        return base[:-1] + ["256"], f"data.tokenizer={str(tok_dir)!r} has 320 ids but model.vocab_size=256"
    if kind == "other-tokenizer":
        other = tmp / "other"
        assert (
            cli.main(["data", "train-tokenizer", "--vocab-size", "300", "--out", str(other), "--max-bytes", "100000"])
            == 0
        )
        return base[:2] + ["--data.tokenizer", str(other)] + base[4:], "was prepared with another tokenizer"
    if kind == "no-token-file":
        return base[2:], "needs a token file prepared with it as data.path, and data.path=None is byte-level text"
    return base[:2] + base[4:], "was prepared with the tokenizer"  # no data.tokenizer


@pytest.mark.parametrize("kind", ["dtype", "vocab", "other-tokenizer", "no-token-file", "no-tokenizer"])
def test_data_tokenizer_model_mismatch_refused_before_launch(
    kind: str, tok_dir: Path, tmp_path: Path, no_launch, capsys
) -> None:
    flags, want = _bad(tok_dir, tmp_path, kind)
    capsys.readouterr()
    assert (
        cli.main(["train", *flags, "--parallel.tp", "1", "--parallel.pp", "1", "--run-dir", str(tmp_path / "r")]) == 2
    )
    err = capsys.readouterr().err
    assert want in err and err.count("\n") == 1 and err.startswith("hybridpar: error: "), err
    assert not (tmp_path / "r").exists()


class EchoPool:
    """Stands in for the replica pool: each request 'generates' its prompt's ids again, from the first,
    up to max_tokens or a stop token (so what comes back is known without a model)."""

    def __init__(self, spec: Any, on_event: Any) -> None:
        self.alive, self.on_event, self.failures = [True] * spec.dp, on_event, []

    def send(self, rep: int, msg: dict[str, Any]) -> bool:
        if msg["type"] == "generate":
            out = []
            for t in (msg["prompt"] * msg["max_tokens"])[: msg["max_tokens"]]:
                out.append(t)
                self.on_event(rep, {"type": "token", "id": msg["id"], "token": t})
                if t in msg["stop_tokens"]:
                    break
            n, reason = len(out), "stop" if out[-1] in msg["stop_tokens"] else "length"
            self.on_event(rep, {"type": "done", "id": msg["id"], "reason": reason, "completion_tokens": n})
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def serve(tok_dir: Path) -> Iterator[Any]:
    from hybridpar.serve.http import make_server
    from hybridpar.serve.service import Service

    servers = []

    def start(vocab: int, tokenizer: Path | None) -> int:
        cfg = ServeConfig(source="init:1", served_model_name="hybridpar", port=0, max_seq_len=256)
        tok = Tokenizer(tokenizer) if tokenizer else None
        svc = Service(cfg, ModelConfig(vocab_size=vocab), cfg.source, pool=EchoPool, tokenizer=tok)
        srv = make_server(svc, "127.0.0.1", 0)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv.server_address[1]

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_text_prompts_go_through_the_tokenizer_or_get_400(serve, tok_dir: Path) -> None:
    tok = Tokenizer(tok_dir)
    text = "import os\nprint(os.getcwd())  # ünïcode\n"
    ids = tok.encode(text)
    port = serve(320, tok_dir)
    status, body = _post(port, "/v1/completions", {"model": "hybridpar", "prompt": text, "max_tokens": len(ids)})
    assert status == 200 and body["choices"][0]["text"] == text and body["usage"]["prompt_tokens"] == len(ids)
    bare = serve(320, None)  # ids >= 256 and no tokenizer: text cannot be read or written
    status, body = _post(bare, "/v1/completions", {"model": "hybridpar", "prompt": text})
    assert status == 400 and "send token ids or give --tokenizer" in body["error"]["message"]
    status, body = _post(bare, "/v1/completions", {"model": "hybridpar", "prompt": ids, "max_tokens": len(ids)})
    assert status == 200 and body["choices"][0]["token_ids"] == ids and body["choices"][0]["text"] == ""
    status, body = _post(
        bare, "/v1/chat/completions", {"model": "hybridpar", "messages": [{"role": "user", "content": "x"}]}
    )
    assert status == 400 and "send token ids or give --tokenizer" in body["error"]["message"]


def test_chat_completions_with_the_openai_client(serve, tok_dir: Path) -> None:
    openai = pytest.importorskip("openai")
    tok = Tokenizer(tok_dir)
    port = serve(320, tok_dir)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    from hybridpar.serve.chat import ChatTemplate

    prompt = ChatTemplate(tok.chat_template).render(messages)
    ids = tok.encode(prompt)
    # The echo "model" repeats the prompt: it reaches <|im_end|> after the system turn and stops there.
    want = prompt[: prompt.index("<|im_end|>")]
    r = client.chat.completions.create(model="hybridpar", messages=messages, max_tokens=200, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop" and r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == ids.index(tok.token_id("<|im_end|>")) + 1
    chunks = list(
        client.chat.completions.create(
            model="hybridpar", messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(ids[:3])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices
    # A byte-level model (vocabulary 256, no tokenizer) chats through the plain default template.
    plain = serve(256, None)
    r = openai.OpenAI(base_url=f"http://127.0.0.1:{plain}/v1", api_key="none", max_retries=0).chat.completions.create(
        model="hybridpar", messages=[{"role": "user", "content": "hi"}], max_tokens=9
    )
    assert r.choices[0].message.content == "user: hi\n" and r.choices[0].finish_reason == "length"
