"""Training: a tiny model learns to reverse, Multi30k loss drops, exact resume, signals, DDP."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import deadline
from qkv.apps.train import lr_at, parse_args, train, train_step
from qkv.data import Batch, default_data_dir
from qkv.generate import greedy_search
from qkv.models import Seq2SeqTransformer, TransformerConfig, load_pretrained

# Tiny models: extra threads only add synchronisation on this shared 2-core machine.
torch.set_num_threads(1)

SRC_DIR = Path(__file__).resolve().parents[2] / "src"
MULTI30K = default_data_dir()
# CI has ../shared beside the clone: there a missing data set is a failure, not a skip.
needs_data = pytest.mark.skipif(
    MULTI30K is None and os.environ.get("CI") != "true", reason="Multi30k not found"
)


def copy_batch(g: torch.Generator, n: int, vocab: int = 14, reverse: bool = False) -> Batch:
    """Source ``x₁..x_L </s>``, target ``x₁..x_L`` (or reversed); symbols 4..vocab-1, L 2..7."""
    lengths = torch.randint(2, 8, (n,), generator=g)
    S = int(lengths.max())
    src = torch.zeros(n, S + 1, dtype=torch.long)
    tgt_in = torch.zeros(n, S + 1, dtype=torch.long)
    tgt_out = torch.zeros(n, S + 1, dtype=torch.long)
    for i, L in enumerate(lengths.tolist()):
        x = torch.randint(4, vocab, (L,), generator=g)
        src[i, : L + 1] = torch.cat([x, torch.tensor([2])])
        y = x.flip(0) if reverse else x
        tgt_in[i, : L + 1] = torch.cat([torch.tensor([1]), y])
        tgt_out[i, : L + 1] = torch.cat([y, torch.tensor([2])])
    return Batch(src, tgt_in, tgt_out)


def test_tiny_model_learns_to_copy():
    torch.manual_seed(0)
    cfg = TransformerConfig(
        src_vocab_size=14, tgt_vocab_size=14, d_model=64, n_heads=4, d_ff=128,
        n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, share_src_tgt_embeddings=True,
    )  # fmt: skip
    model = Seq2SeqTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    test = copy_batch(torch.Generator().manual_seed(123), 300)
    t0, step, exact = time.monotonic(), 0, 0.0
    while step < 600 and exact < 1.0:  # measured: 100% after 200 steps (~17 s)
        model.train()
        for _ in range(50):
            step += 1
            for group in opt.param_groups:
                group["lr"] = lr_at(step, 5e-3, 30)
            train_step(model, copy_batch(g, 128), opt, label_smoothing=0.0)
        out = greedy_search(model.eval(), test.src, max_new_tokens=test.tgt_out.shape[1])
        exact = (out == test.tgt_out).all(dim=1).float().mean().item()
    print(f"copy: exact match {exact:.3f} on 300 held-out after {step} steps, "
          f"{time.monotonic() - t0:.1f}s")  # fmt: skip
    assert exact == 1.0


def tiny_args(out, *extra):
    return parse_args(
        ["--out", str(out), "--train-limit", "300", "--val-limit", "40", "--vocab-size", "500",
         "--d-model", "32", "--heads", "2", "--d-ff", "64", "--layers", "1", "--max-tokens", "500",
         "--warmup", "5", "--threads", "1", "--no-progress", "--val-bleu", "0", *extra]
    )  # fmt: skip


def weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@needs_data
def test_resumed_run_equals_uninterrupted(tmp_path):
    full = train(tiny_args(tmp_path / "a", "--max-steps", "26"))
    assert full["step"] == 26 and full["epoch"] >= 1  # crosses an epoch boundary
    part = train(tiny_args(tmp_path / "b", "--max-steps", "9"))
    assert part["step"] == 9 and part["stopped"] == "max_steps"
    resumed = train(parse_args(["--resume", str(tmp_path / "b"), "--max-steps", "26"]))
    assert resumed["step"] == 26
    a, b = weights(tmp_path / "a" / "last"), weights(tmp_path / "b" / "last")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bitwise: same batches, dropout masks, Adam state
    sa = torch.load(tmp_path / "a" / "last" / "trainer.pt", weights_only=True)
    sb = torch.load(tmp_path / "b" / "last" / "trainer.pt", weights_only=True)
    assert (sa["epoch"], sa["pos"]) == (sb["epoch"], sb["pos"])
    assert torch.equal(sa["rng"], sb["rng"])


@needs_data
def test_small_model_on_2k_pairs_learns(tmp_path):
    args = parse_args(
        ["--out", str(tmp_path), "--train-limit", "2000", "--val-limit", "200", "--vocab-size", "2000",
         "--d-model", "128", "--heads", "4", "--d-ff", "256", "--layers", "2", "--max-tokens", "1500",
         "--lr", "2e-3", "--warmup", "20", "--max-steps", "60", "--dropout", "0.1", "--threads", "1",
         "--no-progress", "--val-bleu", "0", "--final-validate"]
    )  # fmt: skip
    result = train(args)
    # An untrained model scores ~ln(2000) = 7.6 nats; measured after 60 steps (~35 s): 5.09.
    print("2k pairs:", result)
    assert result["val_loss"] < 5.5, result
    model = load_pretrained(tmp_path / "best")
    assert model.cfg.d_model == 128


def run_cli(args: list[str], log: Path) -> subprocess.Popen:
    """``qkv train`` in a subprocess, its output appended to ``log`` (a file, not a pipe: a
    pipe nobody reads fills up and stalls the run)."""
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "qkv", "train", *args]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _tail(log: Path, n: int = 1500) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no output)"


def wait_for(
    proc: subprocess.Popen, log: Path, what: str, done: Callable[[], bool], base: float = 60.0
) -> None:
    """Poll ``done()`` while ``proc`` runs. Fails at once if ``proc`` exits first; after
    ``base`` quiet-machine seconds (scaled by load, tests/deadline.py) kills it and skips
    (machine saturated) or fails, saying what it waited for and how the run's output ends."""
    wait = deadline.Deadline(base, what)
    while not done():
        if proc.poll() is not None:
            pytest.fail(f"qkv train exited ({proc.returncode}) before {what}:\n{_tail(log)}")
        if wait.expired():
            proc.kill()
            proc.wait()
            wait.give_up(f"qkv train was still running; its output ends:\n{_tail(log)}")
        time.sleep(0.1)


@needs_data
def test_sigkill_then_sigint_never_corrupt(tmp_path):
    common = ["--checkpoint-minutes", "0", "--max-steps", "100000"]
    out = tmp_path / "run"
    cli = ["--out", str(out), "--train-limit", "300", "--val-limit", "40", "--vocab-size",
           "500", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--layers", "1",
           "--max-tokens", "500", "--threads", "1", "--no-progress", "--val-bleu", "0", *common]  # fmt: skip
    log = tmp_path / "train.log"
    proc = run_cli(cli, log)
    trainer = out / "last" / "trainer.pt"
    wait_for(proc, log, f"the first checkpoint ({trainer})", trainer.exists)
    time.sleep(1.0)
    proc.kill()  # SIGKILL at an arbitrary moment, maybe mid-save
    proc.wait()
    from qkv.models.io import resolve_dir

    last = resolve_dir(out / "last")  # a complete checkpoint is always there
    state = torch.load(last / "trainer.pt", weights_only=True)
    assert state["step"] >= 1
    load_pretrained(last)
    mtime = (out / "last").stat().st_mtime  # before the resumed run starts saving

    def saved_again() -> bool:
        try:
            return (out / "last").stat().st_mtime != mtime
        except FileNotFoundError:  # between the two renames of a save
            return False

    proc = run_cli(["--resume", str(out)], log)
    wait_for(proc, log, "the resumed run's first checkpoint", saved_again)
    proc.send_signal(signal.SIGINT)  # graceful: checkpoint at the next step, exit 130
    wait = deadline.Deadline(60, "the interrupted run to checkpoint and exit")
    while proc.poll() is None:
        if wait.expired():
            proc.kill()
            proc.wait()
            wait.give_up(f"SIGINT sent; the run's output ends:\n{_tail(log)}")
        time.sleep(0.1)
    assert proc.returncode == 130, _tail(log)
    after = torch.load(out / "last" / "trainer.pt", weights_only=True)
    assert after["step"] > state["step"]
    assert not list(out.glob(".last.tmp-*"))  # a killed run's temp dirs are cleaned up


def cat_batches(a: Batch, b: Batch) -> Batch:
    """The union of two batches, right-padded to the longer one."""

    def cat(x, y):
        T = max(x.shape[1], y.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, T - t.shape[1]))  # noqa: E731
        return torch.cat([pad(x), pad(y)])

    return Batch(cat(a.src, b.src), cat(a.tgt_in, b.tgt_in), cat(a.tgt_out, b.tgt_out))


DDP_CFG = dict(
    src_vocab_size=14, tgt_vocab_size=14, d_model=32, n_heads=4, d_ff=64,
    n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, share_src_tgt_embeddings=True,
)  # fmt: skip


def ddp_batches():
    g = torch.Generator().manual_seed(7)
    return [(copy_batch(g, 8), copy_batch(g, 12)) for _ in range(3)]  # unequal halves


def ddp_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from qkv.distributed.ddp import World

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        Seq2SeqTransformer(TransformerConfig(**DDP_CFG))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # linear in the gradient: no Adam 0/0 noise
    grads = None
    for i, halves in enumerate(ddp_batches()):
        train_step(model, halves[rank], opt, label_smoothing=0.1, world=World(rank, world_size))
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    torch.save({"grads": grads, "params": params}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def test_ddp_two_processes_equal_one_with_doubled_batch(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.spawn(
        ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False
    )
    wait = deadline.Deadline(120, "two gloo ranks training three steps")
    try:
        while not ctx.join(timeout=0.5):  # raises if a rank failed
            if wait.expired():
                codes = [p.exitcode for p in ctx.processes]
                wait.give_up(f"ranks still running (exit codes {codes})")
    finally:
        for p in ctx.processes:  # never leave a rank behind (a give-up, a failed rank)
            if p.is_alive():
                p.kill()
                p.join(5)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for name in r0["grads"]:  # gradients were synchronised (all-reduced) across ranks
        torch.testing.assert_close(r0["grads"][name], r1["grads"][name], atol=0, rtol=0)
    torch.manual_seed(0)
    single = Seq2SeqTransformer(TransformerConfig(**DDP_CFG))
    opt = torch.optim.SGD(single.parameters(), lr=0.5)
    for i, (a, b) in enumerate(ddp_batches()):
        train_step(single, cat_batches(a, b), opt, label_smoothing=0.1)
        if i == 0:
            for name, p in single.named_parameters():
                torch.testing.assert_close(r0["grads"][name], p.grad, atol=1e-6, rtol=1e-4)
    for name, p in single.named_parameters():
        torch.testing.assert_close(r0["params"][name], p.detach(), atol=1e-5, rtol=1e-4)


@needs_data
def test_defaults_learn_and_end_with_a_summary(tmp_path, capsys):
    """The shipped recipe is the default: only the data and the length of the run are cut."""
    out = tmp_path / "run"
    args = parse_args(["--out", str(out), "--train-limit", "400", "--val-limit", "16",
                       "--max-steps", "12", "--threads", "1", "--no-progress"])  # fmt: skip
    assert (args.d_model, args.dropout, args.lr, args.warmup, args.average) == (
        256,
        0.2,
        1e-3,
        150,
        5,
    )
    result = train(args)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    epochs = [r for r in log if "train_loss" in r]
    assert len(epochs) >= 2
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] - 0.5  # it learns
    assert epochs[-1]["val_loss"] < epochs[0]["val_loss"]
    assert any("averaged" in r for r in log)  # the last epochs were averaged and validated
    assert math.isfinite(result["best"]["val_loss"]) and result["best"]["bleu"] >= 0
    text = capsys.readouterr().out
    summary = text[text.index("qkv train: done") :]
    assert "-1.0" not in summary and "Infinity" not in summary and "inf" not in summary
    assert "best validation BLEU" in summary and "qkv translate --model" in summary
    gen = json.loads((out / "best" / "generation.json").read_text())
    assert gen["src"] == "en" and gen["tgt"] == "fr"


def test_help_shows_every_default(capsys):
    from qkv.apps.cli import main

    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--d-model D_MODEL width (default: 256)", "--src SRC source language (default: en)",
                  "--max-tokens MAX_TOKENS tokens per batch (per rank) (default: 3072)"):  # fmt: skip
        assert shown in text, shown


def test_summary_example_is_in_the_source_language():
    from qkv.apps.train import summary

    result = {"epoch": 3, "pos": 0, "step": 30, "stopped": "max_minutes",
              "best": {"bleu": 12.04, "epoch": 2, "val_loss": 2.0}}  # fmt: skip
    text = summary(result, Path("runs/fr"), 90.0, 10, "fr")
    assert 'qkv translate --model runs/fr "Le garçon entraîne le chiot."' in text
    assert "best validation BLEU 12.0 (greedy) at epoch 2" in text
    assert "continue: qkv train --resume runs/fr" in text


# ---- run directories: --out over a run, --overwrite, --resume with other options


def cli(*argv) -> int:
    from qkv.apps.cli import main

    return main(["train", *map(str, argv)])


@pytest.mark.parametrize("entry", ["log.jsonl", "last", "best", "epochs"])
def test_out_over_an_existing_run_is_refused(tmp_path, capsys, entry):
    run = tmp_path / "run"
    run.mkdir()
    if entry == "log.jsonl":
        (run / entry).write_text("{}\n")
    else:
        (run / entry).mkdir()
    before = sorted(p.name for p in run.iterdir())
    assert cli("--out", run, "--max-steps", 1) == 2
    err = capsys.readouterr().err
    assert f"--out {run} already holds a training run ({entry})" in err
    assert f"--resume {run}" in err and "--overwrite" in err
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written
    with pytest.raises(ValueError, match="already holds a training run"):
        train(tiny_args(run))


def test_resume_into_another_out_or_with_overwrite_is_refused(tmp_path, capsys):
    run, other = tmp_path / "run", tmp_path / "other"
    assert cli("--resume", run, "--out", other, "--d-model", 32) == 2
    err = capsys.readouterr().err
    assert f"--resume {run} writes into the run it continues; --out {other}" in err
    assert cli("--resume", run, "--overwrite") == 2
    assert "give one of them" in capsys.readouterr().err
    assert not other.exists() and not run.exists()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished one-step run: d_model 32, 2 heads, 1 layer, vocabulary 500 (~5 s)."""
    run = tmp_path_factory.mktemp("train") / "run"
    train(tiny_args(run, "--max-steps", "1"))
    return run


@needs_data
def test_resume_refuses_other_model_options_and_names_each(tiny_run, capsys):
    state = tiny_run / "last" / "trainer.pt"
    before = state.read_bytes()
    argv = ["--resume", tiny_run, "--d-model", 32, "--heads", 4, "--kv-heads", 2, "--layers", 1,
            "--post-ln", "--vocab-size", 500, "--dropout", 0.2, "--max-steps", 2]  # fmt: skip
    assert cli(*argv) == 2
    err = capsys.readouterr().err
    assert "--heads (the run has 2, given 4)" in err
    assert "--post-ln (the run has False, given True)" in err
    # given but equal (--kv-heads 2: the run's default, its --heads) or left out: not named
    for same in ("--d-model", "--kv-heads", "--layers", "--vocab-size", "--dropout", "--d-ff"):
        assert same not in err, same
    assert state.read_bytes() == before  # the run is untouched
    with pytest.raises(ValueError, match=r"--positional \(the run has sinusoidal, given rope\)"):
        train(parse_args(["--resume", str(tiny_run), "--positional", "rope"]))


@needs_data
def test_resume_accepts_the_runs_own_options_and_out(tiny_run):
    result = train(parse_args(["--resume", str(tiny_run), "--out", str(tiny_run), "--d-model",
                               "32", "--heads", "2", "--max-steps", "1"]))  # fmt: skip
    assert result["step"] == 1 and result["stopped"] == "max_steps"


@needs_data
def test_overwrite_replaces_the_run_cleanly(tmp_path):
    run = tmp_path / "run"
    (run / "epochs").mkdir(parents=True)
    (run / "epochs" / "epoch-009.safetensors").write_bytes(b"old")  # would be averaged
    (run / "best").mkdir()
    (run / "best" / "config.json").write_text("old")  # would be kept if no epoch ended
    (run / "last.old").mkdir()
    (run / "log.jsonl").write_text('{"old": true}\n')
    (run / "notes.txt").write_text("mine")
    # bad input with --overwrite: refused before the old run is touched
    with pytest.raises(ValueError, match="--augment present"):
        train(tiny_args(run, "--overwrite", "--augment", "present", "--src", "fr"))
    assert (run / "log.jsonl").read_text() == '{"old": true}\n'
    assert (run / "epochs" / "epoch-009.safetensors").exists()
    train(tiny_args(run, "--overwrite", "--max-steps", "1"))
    assert sorted(p.name for p in run.iterdir()) == ["best", "last", "log.jsonl", "notes.txt"]
    assert '"old"' not in (run / "log.jsonl").read_text()
    assert load_pretrained(run / "best").cfg.d_model == 32  # the new run's model
    assert (run / "notes.txt").read_text() == "mine"  # not a run's file: left alone
    # a run started with --overwrite, resumed: continues, never deletes itself
    train(parse_args(["--resume", str(run), "--max-steps", "1"]))
    assert len((run / "log.jsonl").read_text().splitlines()) == 2


@needs_data
@pytest.mark.parametrize("augment", ["noise", "present+noise"])
def test_noise_augmentation_adds_its_pairs_to_training_only(augment):
    """--augment noise: qkv.data.noise's pairs (joined, typos, lower case) are added to the
    training pairs, with the run's seed; validation stays as it is."""
    from qkv.apps.train import load_pairs
    from qkv.data.augment import present_tense_pairs
    from qkv.data.noise import noise_pairs

    base = tiny_args("unused")
    args = tiny_args("unused", "--augment", augment)
    train_pairs, plain = load_pairs(args, "train"), load_pairs(base, "train")
    start = plain + (present_tense_pairs(plain) if augment.startswith("present") else [])
    assert train_pairs == start + noise_pairs(start, seed=args.seed)
    assert len(train_pairs) > len(start) and load_pairs(args, "val") == load_pairs(base, "val")
