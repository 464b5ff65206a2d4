"""The command line's contract (docs/errors.md) where it meets the world: stdout that cannot be
written, a port in use, a run to resume that is broken or given other options, Ctrl-C."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import deadline
from qkv.apps.cli import main

# Tiny models: extra threads only add synchronisation on a shared 2-core machine.
torch.set_num_threads(1)


def qkv(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    """``python -m qkv ARGV`` in a fresh process (QKV_DEBUG unset: the one-line errors)."""
    env = {k: v for k, v in os.environ.items() if k != "QKV_DEBUG"}
    return deadline.run([sys.executable, "-m", "qkv", *argv], 120, f"qkv {' '.join(argv)}",
                        env=env, stderr=subprocess.PIPE, text=True, **kwargs)  # fmt: skip


def _close_stdout() -> None:  # in the child, before it runs: `qkv ... >&-`
    os.close(1)


# ---- stdout


@pytest.mark.parametrize("argv", [["translate", "A dog runs."], ["--help"]])
def test_a_closed_stdout_is_an_error_not_a_lost_output(argv):
    res = qkv(*argv, preexec_fn=_close_stdout)
    prog = "qkv translate" if argv[0] == "translate" else "qkv"
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert res.stderr == f"{prog}: error: cannot write to stdout: it is closed\n", res.stderr


def test_a_full_stdout_is_an_error():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        res = qkv("--help", stdout=full)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert res.stderr == "qkv: error: cannot write to stdout: No space left on device\n"


def test_a_reader_that_leaves_ends_the_command_quietly():
    """``qkv ... | head -1``: stdout's reader is gone before the output is written; the
    command ends without a word, exit 141 (128 + SIGPIPE, as a shell tool)."""
    env = {k: v for k, v in os.environ.items() if k != "QKV_DEBUG"}
    proc = subprocess.Popen([sys.executable, "-m", "qkv", "translate", "A dog runs."],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)  # fmt: skip
    proc.stdout.close()  # the reader leaves at once
    wait = deadline.Deadline(120, "qkv translate writing into a closed pipe")
    while proc.poll() is None:
        if wait.expired():
            proc.kill()
            wait.give_up("qkv translate was still running")
        time.sleep(0.05)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.returncode == 141 and err == "", (proc.returncode, err[-2000:])


# ---- qkv serve


def test_serve_on_a_port_in_use_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"qkv serve: error: port 127.0.0.1:{port} is in use"
    ), err


def test_serve_on_an_address_not_here_is_one_line(capsys):
    assert main(["serve", "--host", "192.0.2.1", "--port", "0"]) == 2  # TEST-NET-1: not ours
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "qkv serve: error: cannot listen on 192.0.2.1:0 (--host, --port): "
    ), err


def test_serve_answers_on_the_port_it_bound_and_stops_on_ctrl_c(tmp_path):
    """--port 0: the port the system chose is the one printed and served; Ctrl-C stops the
    server, exit 0 (its normal end)."""
    env = {k: v for k, v in os.environ.items() if k != "QKV_DEBUG"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "qkv", "serve", "--port", "0"],
                                stdout=subprocess.PIPE, stderr=out, env=env)  # fmt: skip
    try:
        line = proc.stdout.readline().decode()  # the first line: the address
        assert line.startswith("qkv serve: http://127.0.0.1:"), (line, log.read_text())
        url = line.split()[2]
        port = int(url.rsplit(":", 1)[1].strip("/"))
        assert port > 0
        wait = deadline.Deadline(60, "qkv serve to answer")
        while True:
            try:
                with urllib.request.urlopen(url + "api/health", timeout=5) as r:
                    assert r.status == 200
                break
            except OSError:
                if wait.expired() or proc.poll() is not None:
                    proc.kill()
                    wait.give_up(f"no answer; its log:\n{log.read_text()[-1500:]}")
                time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=deadline.scaled(30))
        assert proc.returncode == 0, (proc.returncode, log.read_text()[-1500:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# ---- qkv train: resume, Ctrl-C

EN = ["a dog runs", "a cat sits", "two dogs play", "a man walks", "the boy reads",
      "a girl sings", "the dog sleeps", "a woman rides", "two cats run", "the man eats"]  # fmt: skip
FR = ["un chien court", "un chat est assis", "deux chiens jouent", "un homme marche",
      "le garçon lit", "une fille chante", "le chien dort", "une femme roule",
      "deux chats courent", "l'homme mange"]  # fmt: skip


def tiny_data(directory: Path) -> list[str]:
    """Parallel text files (40 training pairs, 10 validation pairs) and the options of a
    tiny model on them: a step takes milliseconds."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, lines in (("train.en", EN * 4), ("train.fr", FR * 4), ("val.en", EN),
                        ("val.fr", FR)):  # fmt: skip
        (directory / name).write_text("\n".join(lines) + "\n")
    return ["--train-files", str(directory / "train.en"), str(directory / "train.fr"),
            "--val-files", str(directory / "val.en"), str(directory / "val.fr"),
            "--vocab-size", "300", "--d-model", "16", "--heads", "2", "--d-ff", "32",
            "--layers", "1", "--max-tokens", "64", "--threads", "1", "--no-progress",
            "--val-bleu", "0", "--keep-epochs", "0", "--average", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished two-step run on tiny_data; returns (run directory, its data options)."""
    base = tmp_path_factory.mktemp("resume")
    opts = tiny_data(base / "data")
    assert main(["train", "--out", str(base / "run"), *opts, "--max-steps", "2"]) == 0
    return base / "run", opts


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    """A copy of the tiny run, to damage."""
    import shutil

    run, opts = tiny_run
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", opts


@pytest.mark.parametrize(
    ("file", "damage", "says"),
    [("trainer.pt", "truncate", "not a trainer state, truncated or damaged"),
     ("trainer.pt", "random", "not a trainer state, truncated or damaged"),
     ("trainer.pt", "a dict without args", "missing key 'args'"),
     ("model.safetensors", "random", "not a safetensors file"),
     ("model.safetensors", "truncate", "truncated")],
)  # fmt: skip
def test_resume_from_a_broken_checkpoint_is_one_line_naming_the_file(run_copy, capsys, file,
                                                                     damage, says):  # fmt: skip
    run, _ = run_copy
    path = run / "last" / file
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "random":
        path.write_bytes(os.urandom(len(data)))
    else:
        torch.save({"step": 1}, path)
    assert main(["train", "--resume", str(run), "--max-steps", "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"qkv train: error: {path}: "), err
    assert says in err[0], err


def test_resume_refuses_other_data_or_training_options_naming_both(tiny_run, tmp_path, capsys):
    """--resume continues a run with its own data and options: another --train-files (or
    --lr, --seed...) is refused, never ignored; the run's own values are accepted."""
    run, opts = tiny_run
    before = (run / "last" / "trainer.pt").read_bytes()
    other = tiny_data(tmp_path / "other")
    argv = ["train", "--resume", str(run), "--train-files", *other[1:3], "--max-steps", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"qkv train: error: --resume {run}: "), err
    assert f"--train-files (the run has {opts[1]} {opts[2]}, given {other[1]} {other[2]})" in err[0]
    assert main(["train", "--resume", str(run), "--lr", "0.5", "--seed", "7", "--bf16"]) == 2
    err = capsys.readouterr().err
    for said in ("--lr (the run has 0.001, given 0.5)", "--seed (the run has 1, given 7)",
                 "--bf16 (the run has False, given True)"):  # fmt: skip
        assert said in err, err
    assert (run / "last" / "trainer.pt").read_bytes() == before  # untouched
    # the run's own values: accepted, and the run continues
    assert (
        main(["train", "--resume", str(run), *opts[:3], "--lr", "0.001", "--max-steps", "3"]) == 0
    )


def test_ctrl_c_checkpoints_then_says_interrupted(tmp_path):
    """SIGINT during training: the run checkpoints at the next step and exits 130 with the
    documented ``qkv train: interrupted`` as the last line on stderr."""
    opts = tiny_data(tmp_path / "data")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "QKV_DEBUG"}
    env["OMP_NUM_THREADS"] = "1"
    log = tmp_path / "stdout.log"
    with open(log, "wb") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "qkv", "train", "--out", str(out), *opts,
                                 "--checkpoint-minutes", "0", "--max-steps", "1000000"],
                                stdout=stdout, stderr=subprocess.PIPE, env=env)  # fmt: skip
    trainer = out / "last" / "trainer.pt"
    wait = deadline.Deadline(60, f"the first checkpoint ({trainer})")
    while not trainer.exists():
        if proc.poll() is not None or wait.expired():
            proc.kill()
            err = proc.communicate()[1].decode()
            wait.give_up(f"qkv train ended or hung before its first checkpoint:\n{err[-1500:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=deadline.scaled(60))
    except subprocess.TimeoutExpired:
        proc.kill()
        err = proc.communicate()[1]
        pytest.fail(f"qkv train did not stop after SIGINT:\n{err.decode()[-1500:]}")
    err = err.decode()
    assert proc.returncode == 130, (proc.returncode, err[-1500:])
    assert err.endswith("qkv train: interrupted\n") and "Traceback" not in err, err[-1500:]
    assert "done (interrupted)" in log.read_text()  # the summary, then the line
    assert torch.load(trainer, weights_only=True)["step"] >= 1
