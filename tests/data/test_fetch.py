"""``qkv data fetch``: pinned, checked, resumable, atomic; then train and evaluate find the data.

Nothing here reaches the internet: the files come from a local mirror, a file:// URL or a
server on 127.0.0.1, whose small fixture files' digests replace the recorded table
(``qkv.data.fetch.FILES``) for the test; one test fetches ../shared/data/multi30k itself
against the real table.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import qkv.data.corpus as corpus
import qkv.data.fetch as fetch_mod
from qkv.apps import data_cli
from qkv.apps.cli import main
from qkv.data import SPLITS, multi30k
from qkv.data.fetch import FILES, FetchError, base_url, fetch

LANGS = ("en", "fr", "de")
WORDS = {
    "en": ["a dog runs", "the cat sleeps", "two men walk", "a girl reads", "the boy swims"],
    "fr": ["un chien court", "le chat dort", "deux hommes marchent", "une fille lit", "le garçon nage"],
    "de": ["ein hund rennt", "die katze schläft", "zwei männer gehen", "ein mädchen liest", "der junge schwimmt"],
}  # fmt: skip
LINES = {"train": 60, "val": 8, "test_2016_flickr": 5, "test_2017_flickr": 5}


def _text(split: str, lang: str) -> bytes:
    words = WORDS[lang]
    lines = [f"{words[i % 5]} {i} ." for i in range(LINES[split])]
    return ("\n".join(lines) + "\n").encode()


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A directory of small Multi30k-shaped files, and the recorded table made theirs."""
    root = tmp_path / "mirror"
    root.mkdir()
    table = {}
    for split in SPLITS:
        for lang in LANGS:
            name = f"{split}.{lang}.gz"
            data = gzip.compress(_text(split, lang), mtime=0)
            (root / name).write_bytes(data)
            table[name] = (len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(fetch_mod, "FILES", table)
    return root


@pytest.fixture
def no_default_data(tmp_path, monkeypatch):
    """No ../shared/data/multi30k to be found and no $QKV_DATA: the user cache dir is the
    default, under a temporary $XDG_CACHE_HOME."""
    monkeypatch.delenv("QKV_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(corpus, "PROJECT_ROOT", tmp_path / "project" / "root")
    (tmp_path / "work" / "here").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "here")
    return tmp_path / "cache" / "qkv" / "multi30k"


class _Server:
    """Files of ``root`` over HTTP on 127.0.0.1, honouring ``Range: bytes=N-``; ``cut_after``
    bytes of a body and the connection drops (an interrupted download)."""

    def __init__(self, root: Path) -> None:
        self.root, self.cut_after, self.requests = root, None, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = server.root / self.path.lstrip("/")
                if not path.is_file():
                    self.send_error(404)
                    return
                data, rng = path.read_bytes(), self.headers.get("Range")
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
                body = data[start:]
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                sent = body if server.cut_after is None else body[: server.cut_after]
                self.wfile.write(sent)
                self.close_connection = True
                server.requests.append((self.path, rng, len(sent)))

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(mirror):
    s = _Server(mirror)
    yield s
    s.close()


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def _one_error_line(capsys, prog: str = "qkv data fetch") -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return err


# ---- the recorded table


def test_recorded_files_are_the_layout_qkv_reads():
    assert set(FILES) == {f"{s}.{lang}.gz" for s in SPLITS for lang in LANGS}
    assert all(len(d) == 64 and size > 10_000 for size, d in FILES.values())
    assert fetch_mod.COMMIT in fetch_mod.BASE_URL and len(fetch_mod.COMMIT) == 40


def test_the_projects_own_copy_matches_the_recorded_digests(tmp_path):
    """../shared/data/multi30k through file://: every recorded size and sha256 holds."""
    shared = corpus.PROJECT_ROOT.parent / "shared" / "data" / "multi30k"
    if not shared.is_dir():
        pytest.skip("no ../shared/data/multi30k here")
    got = fetch(tmp_path / "d", shared.as_uri())
    assert [f.status for f in got] == ["downloaded"] * 12
    assert multi30k("val", "en", "de", tmp_path / "d") == multi30k("val", "en", "de", shared)


# ---- fetching


def test_fetch_writes_the_layout_and_says_so(mirror, tmp_path, capsys):
    d = tmp_path / "data"
    assert main(["data", "fetch", "--dir", str(d), "--url", mirror.as_uri()]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"Multi30k task 1 (en, fr, de) from {mirror.as_uri()}"
    assert len(out) == 1 + 12 + 1
    for line, (name, (size, _)) in zip(out[1:-1], fetch_mod.FILES.items()):
        assert line.split()[:2] == ["downloaded", str(d / name)] and f"{size:,} bytes" in line
    assert out[-1].startswith(f"Multi30k is in {d} (12 files")
    assert f"qkv train --data {d}" in out[-1]
    assert _listing(d) == sorted(fetch_mod.FILES)  # no .part left
    for name in fetch_mod.FILES:
        assert (d / name).read_bytes() == (mirror / name).read_bytes()
    assert multi30k("val", "fr", "de", d)[0] == ("un chien court 0 .", "ein hund rennt 0 .")


def test_a_second_fetch_checks_and_downloads_nothing(mirror, tmp_path, capsys):
    d = tmp_path / "data"
    fetch(d, mirror.as_uri())
    for p in mirror.iterdir():  # the mirror is gone: nothing may be asked of it
        p.unlink()
    assert main(["data", "fetch", "--dir", str(d), "--url", mirror.as_uri()]) == 0
    lines = capsys.readouterr().out.splitlines()[1:-1]
    assert [line.split()[0] for line in lines] == ["present"] * 12


def test_a_local_directory_is_a_mirror_too(mirror, tmp_path):
    assert base_url(str(mirror)) == mirror.resolve().as_uri()
    assert [f.status for f in fetch(tmp_path / "d", str(mirror))] == ["downloaded"] * 12


def test_an_interrupted_download_resumes_where_it_stopped(server, tmp_path, capsys):
    d = tmp_path / "data"
    size = fetch_mod.FILES["train.en.gz"][0]
    server.cut_after = 100  # the connection drops after 100 bytes of the first file
    assert main(["data", "fetch", "--dir", str(d), "--url", server.url]) == 2
    err = _one_error_line(capsys)
    assert f"cut short at 100 of {size} bytes" in err and "run it again to resume" in err
    assert _listing(d) == ["train.en.gz.part"]  # no half-written train.en.gz
    assert (d / "train.en.gz.part").stat().st_size == 100

    server.cut_after = None
    assert main(["data", "fetch", "--dir", str(d), "--url", server.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["resumed", str(d / "train.en.gz")]
    assert server.requests[1] == ("/train.en.gz", "bytes=100-", size - 100)  # only the rest
    assert _listing(d) == sorted(fetch_mod.FILES)
    assert (d / "train.en.gz").read_bytes() == (server.root / "train.en.gz").read_bytes()


def test_a_part_with_wrong_bytes_is_dropped_and_fetched_again(server, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "val.en.gz.part").write_bytes(b"not the start of the file")
    (d / "val.fr.gz.part").write_bytes((server.root / "val.fr.gz").read_bytes())  # all there
    got = {f.name: f.status for f in fetch(d, server.url)}
    assert got["val.en.gz"] == "downloaded"  # the resumed bytes failed their digest: again from 0
    assert got["val.fr.gz"] == "resumed" and "/val.fr.gz" not in [r[0] for r in server.requests]
    assert (d / "val.en.gz").read_bytes() == (server.root / "val.en.gz").read_bytes()
    assert [r[1] for r in server.requests if r[0] == "/val.en.gz"] == ["bytes=25-", None]


def test_a_part_over_file_url_is_finished_from_the_whole_file(mirror, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    data = (mirror / "train.fr.gz").read_bytes()
    (d / "train.fr.gz.part").write_bytes(data[:1000])  # file:// ignores Range: sent whole
    fetch(d, mirror.as_uri())
    assert (d / "train.fr.gz").read_bytes() == data and _listing(d) == sorted(fetch_mod.FILES)


@pytest.mark.parametrize("damage", ["flip", "longer", "shorter"])
def test_a_corrupted_file_is_refused_and_nothing_is_left(damage, mirror, tmp_path, capsys):
    data = bytearray((mirror / "val.fr.gz").read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "longer":
        data += b"x"
    else:
        del data[-5:]
    (mirror / "val.fr.gz").write_bytes(bytes(data))
    d = tmp_path / "data"
    assert main(["data", "fetch", "--dir", str(d), "--url", mirror.as_uri()]) == 2
    err = _one_error_line(capsys)
    assert "val.fr.gz" in err and "nothing written" in err
    assert "val.fr.gz" not in _listing(d) and "val.fr.gz.part" not in _listing(d)
    assert "train.en.gz" in _listing(d)  # the good files before it stay (the next run skips them)


def test_a_file_in_the_way_is_left_alone(mirror, tmp_path, capsys):
    d = tmp_path / "data"
    d.mkdir()
    (d / "val.en.gz").write_bytes(b"my own")
    assert main(["data", "fetch", "--dir", str(d), "--url", mirror.as_uri()]) == 2
    assert "is there but is not the recorded val.en.gz" in _one_error_line(capsys)
    assert (d / "val.en.gz").read_bytes() == b"my own"


def test_the_library_call_reports_each_file_and_its_progress(mirror, tmp_path):
    said, seen = [], []
    table = {"val.en.gz": fetch_mod.FILES["val.en.gz"]}
    got = fetch(tmp_path / "d", mirror.as_uri(), files=table, said=said.append,
                progress=lambda *a: seen.append(a))  # fmt: skip
    assert said == got and got[0].size == table["val.en.gz"][0]
    assert seen[-1] == ("val.en.gz", got[0].size, got[0].size)


def test_a_missing_file_on_the_server_is_named(server, tmp_path):
    with pytest.raises(FetchError, match=r"cannot download http://.*/nope/train.en.gz: HTTP 404"):
        fetch(tmp_path / "d", server.url + "/nope")
    assert _listing(tmp_path / "d") == []


def test_progress_is_shown_once_a_file_takes_a_second():
    clock = iter([0.0, 0.5, 1.5, 2.0, 3.0])
    log = io.StringIO()  # not a terminal: whole lines, at most one per 10 s, and the end
    p = data_cli._Progress(log, clock=lambda: next(clock))
    for done in (10, 20, 40, 60, 100):
        p("train.en.gz", done * 1024, 100 * 1024)
    assert log.getvalue() == "train.en.gz   40%  40/100 KiB\ntrain.en.gz  100%  100/100 KiB\n"


# ---- the command line's one-line errors


@pytest.mark.parametrize("argv,needle", [
    (["data"], "required: ACTION"),
    (["data", "fetch", "--url", "ftp://example.org/x"], "https://, http:// or file://"),
    (["data", "fetch", "--url", "no/such/dir"], "or a directory"),
    (["data", "fetch", "--dir", "afile"], "not a directory"),
    (["data", "fetch", "--bogus"], "unrecognized arguments"),
])  # fmt: skip
def test_bad_options_are_one_line(argv, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(argv) == 2
    prog = "qkv data" if argv == ["data"] else "qkv data fetch"
    assert needle in _one_error_line(capsys, prog)
    assert _listing(tmp_path) == ["afile"]


def test_an_unreachable_source_is_one_line(mirror, tmp_path, capsys):
    assert main(["data", "fetch", "--dir", str(tmp_path / "d"), "--url",
                 (tmp_path / "gone").as_uri()]) == 2  # fmt: skip
    assert "cannot download file://" in _one_error_line(capsys)
    with _ServerClosed() as url:
        assert main(["data", "fetch", "--dir", str(tmp_path / "d"), "--url", url]) == 2
    assert "cannot download http://127.0.0.1" in _one_error_line(capsys)
    assert _listing(tmp_path / "d") == []


class _ServerClosed:
    """A 127.0.0.1 URL nobody listens on."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"http://127.0.0.1:{port}/multi30k"

    def __exit__(self, *exc) -> None:
        pass


# ---- train and evaluate find what was fetched


def test_without_data_train_and_evaluate_say_to_fetch(no_default_data, capsys):
    assert corpus.default_data_dir() is None
    for command in (["train", "--out", "run"], ["evaluate", "--limit", "2"]):
        assert main(command) == 2
        err = _one_error_line(capsys, f"qkv {command[0]}")
        assert err == (f"qkv {command[0]}: error: no Multi30k data in {no_default_data}: run "
                       "`qkv data fetch` (or pass --data DIR)\n")  # fmt: skip


def test_train_and_evaluate_find_the_fetched_data(mirror, no_default_data, tmp_path, capsys):
    assert main(["data", "fetch", "--url", mirror.as_uri()]) == 0  # the default --dir
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"Multi30k is in {no_default_data} (12 files")
    assert out[-1].endswith("train and evaluate find it there without --data")
    assert corpus.default_data_dir() == no_default_data
    assert main(["evaluate", "--split", "val", "--limit", "2", "--beam", "1"]) == 0
    assert "val en->fr beam=1: BLEU" in capsys.readouterr().out
    run = tmp_path / "run"
    argv = ["train", "--out", str(run), "--vocab-size", "300", "--d-model", "16", "--heads", "2",
            "--d-ff", "32", "--layers", "1", "--max-steps", "1", "--threads", "1",
            "--no-progress", "--val-bleu", "0", "--src", "de", "--tgt", "fr"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert (run / "best" / "config.json").is_file()


def test_qkv_data_names_the_directory_and_wins(mirror, tmp_path, monkeypatch, capsys):
    d = tmp_path / "mine"
    monkeypatch.setenv("QKV_DATA", str(d))
    assert corpus.user_data_dir() == d and corpus.default_data_dir() == d
    assert main(["evaluate", "--limit", "1"]) == 2  # set but empty: an error, not a fallback
    assert "missing data directory" in _one_error_line(capsys, "qkv evaluate")
    assert main(["data", "fetch", "--url", mirror.as_uri()]) == 0
    assert _listing(d) == sorted(fetch_mod.FILES)
    assert len(multi30k("test_2017_flickr", "en", "fr")) == 5
