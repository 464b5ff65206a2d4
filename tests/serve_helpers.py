"""Shared fixtures of the ``qkv serve`` tests: a tiny saved translator, a registry, and a
real server on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from qkv.apps.serve.models import Registry, default_registry
from qkv.data import Tokenizer
from qkv.models import Seq2SeqTransformer, TransformerConfig, save_pretrained

SENTS = ["a dog runs", "the boy trains the puppy", "le chien court", "le garçon entraîne le chiot"]


def tiny_translator(directory: Path) -> Path:
    """A small seq2seq model, fitted for a few steps on two pairs, saved with its tokenizer."""
    tok = Tokenizer.train(SENTS * 10, vocab_size=340)
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size,
                            d_model=32, n_heads=4, d_ff=64, dropout=0.0, n_encoder_layers=2,
                            n_decoder_layers=2)  # fmt: skip
    model = Seq2SeqTransformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pairs = [(SENTS[0], SENTS[2]), (SENTS[1], SENTS[3])]
    with one_thread():
        for _ in range(15):
            for s, t in pairs:
                src = torch.tensor([tok.encode(s) + [2]])  # (1, S)
                tgt = torch.tensor([[1, *tok.encode(t), 2]])  # (1, T)
                logits = model(src, tgt[:, :-1])  # (1, T - 1, V)
                loss = torch.nn.functional.cross_entropy(logits[0], tgt[0, 1:])
                opt.zero_grad()
                loss.backward()
                opt.step()
    return save_pretrained(model.eval(), directory, tokenizer=tok)


@contextmanager
def one_thread():
    """torch on one thread while serving (small models: threads only contend)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


_SAVED: dict[str, Path] = {}


def registry(tmp: Path, *, minilm: bool = True) -> Registry:
    """MiniLM (optional), random, and the tiny translator as ``tiny-fr`` (trained once per run)."""
    if "tiny-fr" not in _SAVED:
        _SAVED["tiny-fr"] = tiny_translator(tmp / "tiny-fr")
    reg = default_registry({"tiny-fr": str(_SAVED["tiny-fr"])})
    if not minilm:
        reg._entries.pop("minilm")
    return reg


@contextmanager
def running_server(app) -> Iterator[int]:
    """``app`` served as ``qkv serve`` serves it (uvicorn, :class:`TimedH11Protocol`) on
    127.0.0.1 in a thread; yields the port. The socket is bound here: no free-port race."""
    import uvicorn

    from qkv.apps.serve.server import TimedH11Protocol

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            http=TimedH11Protocol)  # fmt: skip
    srv = uvicorn.Server(config)
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        stop = time.monotonic() + 20
        while not srv.started:
            assert th.is_alive() and time.monotonic() < stop, "uvicorn did not start"
            time.sleep(0.02)
        yield port
    finally:
        srv.should_exit = True
        th.join(timeout=10)
        sock.close()


def page_ready(page) -> None:
    """Wait until the explorer page has finished its current request (``data-ready``)."""
    page.wait_for_timeout(50)
    page.wait_for_selector("body[data-ready='1']")


def post_json(server: str, **body) -> dict:
    """POST ``body`` to ``server``'s /api/attention (``http://host:port``); the JSON answer."""
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/api/attention", json.dumps(body), {"Content-Type": "application/json"})
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out
