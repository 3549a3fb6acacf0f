"""Paths: saving never replaces a special file, input files are
regular and bounded, and a path never splits the CLI's one-line error.

Each table case checks that nothing was written, replaced or lost: the target keeps its
``lstat`` identity (mode, device number, inode, link text), the folder holds no new file,
and the session's state is bitwise unchanged after a refused save.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import kvstate.testing.models
from kvstate import Session, load_state
from kvstate.cli import main
from kvstate.errors import InputFileError, SaveTargetError
from kvstate.io.paths import DEFAULT_MAX_INPUT_BYTES, MAX_INPUT_ENV, read_bounded
from tiny import assert_same_state, prompt, snapshot, tiny_model


@pytest.fixture(scope="module")
def session():
    s = Session(tiny_model("llama"))
    s.extend(prompt(6))
    return s


def char_device(folder: Path) -> Path:
    """A private copy of /dev/null's node when we may make one (root): a regression then clobbers
    only it; /dev/null itself otherwise, which a non-root save could never replace."""
    node = folder / "null-node"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (OSError, AttributeError):
        return Path("/dev/null")
    return node


def hostile_targets(t: Path) -> dict[str, Path]:
    """Save targets that must be refused, made in ``t``."""
    os.mkfifo(t / "fifo")
    (t / "folder").mkdir()
    (t / "file.txt").write_text("x")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(t / "sock"))  # the node stays after close
    sock.close()
    device = char_device(t)
    links = {"dangling": "nowhere.kvs", "to-fifo": "fifo", "to-folder": "folder", "to-device": str(device),
             "loop": "loop"}
    for name, to in links.items():
        os.symlink(to, t / name)
    return {
        "a FIFO": t / "fifo", "a character device": device, "a socket": t / "sock", "a folder": t / "folder",
        "a dangling symlink": t / "dangling", "a symlink to a FIFO": t / "to-fifo",
        "a symlink to a folder": t / "to-folder", "a symlink to a character device": t / "to-device",
        "a symlink loop": t / "loop", "a missing folder": t / "missing" / "x.kvs",
        "a file used as a folder": t / "file.txt" / "x.kvs", "a /proc file": Path("/proc/self/environ"),
    }


def identity(path: Path) -> tuple | None:
    """What must not change about a refused target: its lstat identity, or its absence."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    return stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino, st.st_dev, link


def listing(folder: Path) -> list[str]:
    """The folder's names once kvstate's I/O thread is idle: a save frees the file it replaced there."""
    from kvstate.io.checksum import run_beside

    run_beside(lambda: None).result()
    return sorted(p.name for p in folder.iterdir())


def test_session_save_refuses_every_special_target(tmp_path, session):
    before_state = snapshot(session.state)
    for name, target in hostile_targets(tmp_path).items():
        before, files = identity(target), listing(tmp_path)
        with pytest.raises(SaveTargetError) as info:
            session.save(target)
        assert "\n" not in str(info.value), name
        assert identity(target) == before, f"{name}: the target changed"
        assert listing(tmp_path) == files, f"{name}: a file was left behind"
        assert_same_state(session.state, before_state)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_the_cli_refuses_them_before_any_model_loads(tmp_path, session, monkeypatch, capsys):
    (tmp_path / "doc.txt").write_text("The lighthouse keeper climbed the stairs.")
    session.save(tmp_path / "s.kvs")

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the output path was checked")

    monkeypatch.setattr(kvstate.testing.models, "load_model", never)
    commands = {
        "prefill --out": ["prefill", "--prompt-file", str(tmp_path / "doc.txt"), "--out"],
        "generate --save": ["generate", "--state", str(tmp_path / "s.kvs"), "--prompt", "hi", "--save"],
        "verify --markdown": ["verify", "--model", "tiny:llama", "--markdown"],
    }
    for name, target in hostile_targets(tmp_path).items():
        for command, argv in commands.items():
            before, files = identity(target), listing(tmp_path)
            assert main([*argv, str(target)]) == 2, f"{command} {name}"
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("kvstate: error: SaveTargetError"), (command, name, err)
            assert identity(target) == before and listing(tmp_path) == files, f"{command} {name}"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_symlink_to_a_regular_file_is_written_through(tmp_path, session):
    """The file the link points to is replaced (atomically, in its own folder); the link stays."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    real = tmp_path / "b" / "real.kvs"
    real.write_bytes(b"an older state")
    link = tmp_path / "a" / "link.kvs"
    os.symlink("../b/real.kvs", link)
    size = session.save(link)
    assert os.readlink(link) == "../b/real.kvs" and real.stat().st_size == size
    assert_same_state(load_state(real), session.state)
    assert listing(tmp_path / "a") == ["link.kvs"] and listing(tmp_path / "b") == ["real.kvs"]


def test_a_save_deletes_only_the_leftovers_it_can_prove_are_its_own(tmp_path, session):
    """A killed save leaves ``.<name>.<pid>.<8 hex>.tmp|old``; the next save to that file deletes the
    ones whose writer is dead. A live writer's, another target's and anything else stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        target = tmp_path / "s.kvs"
        session.save(target)
        whole = target.read_bytes()
        gone = [f".s.kvs.{dead.pid}.0123abcd.old", f".s.kvs.{dead.pid}.89abcdef.tmp"]
        kept = [f".s.kvs.{live.pid}.0123abcd.old", f".s.kvs.{live.pid}.89abcdef.tmp",
                f".other.kvs.{dead.pid}.0123abcd.old", f".s.kvs.{dead.pid}.0123abcd.old.bak",
                f".s.kvs.{dead.pid}.nothex00.old", f"s.kvs.{dead.pid}.0123abcd.old"]
        for name in gone + kept:
            (tmp_path / name).write_bytes(whole)
        os.symlink("s.kvs", tmp_path / f".s.kvs.{dead.pid}.fedcba98.old")  # not a regular file: kept
        kept.append(f".s.kvs.{dead.pid}.fedcba98.old")
        session.save(target)
        assert listing(tmp_path) == sorted(["s.kvs", *kept])
        assert all((tmp_path / name).read_bytes() == whole for name in kept[:-1])  # untouched
    finally:
        live.kill()
        live.wait()


@pytest.fixture
def inputs(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/dev/zero", tmp_path / "zero")
    (tmp_path / "folder").mkdir()
    with open(tmp_path / "huge.txt", "wb") as f:  # sparse: the cap must refuse it without reading it
        f.truncate(DEFAULT_MAX_INPUT_BYTES + 1)
    (tmp_path / "small.txt").write_text("0123456789")
    return tmp_path


def input_cases(t: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (argv, environment): every one must end in exit 2 without reading the file."""
    prefill = ["prefill", "--out", str(t / "o.kvs"), "--prompt-file"]
    verify = ["verify", "--model", "tiny:llama", "--prompt-file"]
    return {
        "prefill: a symlink to /dev/zero": ([*prefill, str(t / "zero")], {}),
        "prefill: a FIFO": ([*prefill, str(t / "fifo")], {}),
        "prefill: a folder": ([*prefill, str(t / "folder")], {}),
        "prefill: over the default cap": ([*prefill, str(t / "huge.txt")], {}),
        "prefill: over --max-input-bytes": ([*prefill, str(t / "small.txt"), "--max-input-bytes", "9"], {}),
        "prefill: over the environment's cap": ([*prefill, str(t / "small.txt")], {MAX_INPUT_ENV: "9"}),
        "prefill: a malformed environment cap": ([*prefill, str(t / "small.txt")], {MAX_INPUT_ENV: "lots"}),
        "prefill: a /proc file larger than it says": ([*prefill, "/proc/self/maps", "--max-input-bytes", "16"], {}),
        "verify: a symlink to /dev/zero": ([*verify, str(t / "zero")], {}),
        "verify: a FIFO": ([*verify, str(t / "fifo")], {}),
        "verify: over --max-input-bytes": ([*verify, str(t / "small.txt"), "--max-input-bytes", "9"], {}),
        "generate --state: a symlink to /dev/zero": (["generate", "--prompt", "x", "--state", str(t / "zero")], {}),
        "inspect: a FIFO": (["inspect", str(t / "fifo")], {}),
    }


def test_every_input_file_is_regular_and_bounded(inputs, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("a model was loaded before the input file was checked")

    monkeypatch.setattr(kvstate.testing.models, "load_model", never)
    for name, (argv, env) in input_cases(inputs).items():
        files = listing(inputs)
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("kvstate: error:"), (name, err)
        assert "InputFileError" in err or "StateFileError" in err, (name, err)
        assert listing(inputs) == files, name
    assert stat.S_ISFIFO(os.lstat(inputs / "fifo").st_mode)


def test_a_bounded_read_stops_at_the_cap(inputs):
    """Exactly the cap is read whole; one byte more is refused, whatever size the file claims."""
    assert read_bounded(inputs / "small.txt", 10) == b"0123456789"
    assert read_bounded(os.path.realpath(inputs / "small.txt"), 11) == b"0123456789"
    for path, limit in [(inputs / "small.txt", 9), ("/proc/self/maps", 16)]:
        with pytest.raises(InputFileError, match="larger than the input cap"):
            read_bounded(path, limit)


def test_the_cap_is_documented(capsys):
    for command in ("prefill", "verify"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "--max-input-bytes" in out and MAX_INPUT_ENV in out, out
    docs = (Path(__file__).parent.parent / "docs" / "state-file.md").read_text()
    assert MAX_INPUT_ENV in docs and "symlink" in docs


def test_control_characters_in_a_path_keep_the_error_on_one_line(tmp_path, capsys):
    weird = ["line\nbreak", "carriage\rreturn", "escape\x1b[31m", "tab\there", "nul\u2028sep"]
    for text in weird:
        cases = {
            "a missing prompt file": ["prefill", "--prompt-file", str(tmp_path / text), "--out", "o.kvs"],
            "a missing folder to save into": ["prefill", "--prompt-file", str(tmp_path / text),
                                              "--out", str(tmp_path / text / "o.kvs")],
            "inspect of a missing file": ["inspect", str(tmp_path / text)],
            "generate --save into a missing folder": ["generate", "--state", str(tmp_path / "x.kvs"),
                                                      "--save", str(tmp_path / text / "o.kvs")],
        }
        for name, argv in cases.items():
            assert main(argv) == 2, (name, text)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("kvstate: error:"), (name, err)
            assert repr(text)[1:-1] in err, (name, err)  # escaped, not dropped


def test_a_model_folder_holds_only_regular_files_of_plausible_size(tmp_path):
    """transformers reads a folder's configs and tokenizer files whole: refused before it opens them."""
    from kvstate.io.paths import MAX_MODEL_TEXT_BYTES
    from kvstate.testing.models import load_model

    def fifo(path):
        os.mkfifo(path)

    def sparse(path):
        with open(path, "wb") as f:
            f.truncate(MAX_MODEL_TEXT_BYTES + 1)

    cases = {
        "a FIFO as tokenizer.json": ("tokenizer.json", fifo),
        "a link to /dev/zero as tokenizer_config.json": ("tokenizer_config.json",
                                                         lambda p: os.symlink("/dev/zero", p)),
        "an oversized tokenizer.json": ("tokenizer.json", sparse),
    }
    for name, (file, make) in cases.items():
        folder = tmp_path / name.replace(" ", "-").replace("/", "")
        tiny_model("llama").save_pretrained(folder)
        make(folder / file)
        before = listing(folder)
        with pytest.raises(InputFileError, match="model folder"):
            load_model(str(folder), need_tokenizer="test")
        assert listing(folder) == before, name
