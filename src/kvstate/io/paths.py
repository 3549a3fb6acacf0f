"""Which paths kvstate may write a state file to or read an input from, checked before any work.

A save replaces a *regular file* or creates a new one, and nothing else: a device, FIFO,
socket, folder or dangling symlink is refused, because the rename that makes a save
crash-safe would turn it into a regular file (as root, ``/dev/null`` itself). A symlink to
a regular file is written through: the file it points to is replaced, the link is kept.
Temporary and second names are ``.<name>.<pid>.<8 hex>.tmp|old`` beside the target; a save
deletes those of the same target whose writer has died (a SIGKILL leaves them behind).

Inputs (prompt files) must be regular files after symlinks are resolved, and are read with
a bounded read of at most ``limit + 1`` bytes, so a file that grows, or a ``/proc`` file
that reports size 0, cannot exhaust memory either.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import stat
import uuid
from pathlib import Path

from ..errors import InputFileError, SaveTargetError

MAX_INPUT_ENV = "KVSTATE_MAX_INPUT_BYTES"
DEFAULT_MAX_INPUT_BYTES = 64 * 2**20  # far above any prompt; far below what would exhaust memory
MAX_MODEL_TEXT_BYTES = 2**30  # a model folder's JSON and vocabulary files (the largest tokenizer.json: ~35 MB)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx")


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    kinds = ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink"),
             (stat.S_ISREG, "regular file"))
    return next((name for test, name in kinds if test(mode)), "special file")


def temp_name(target: Path, suffix: str) -> Path:
    """A fresh name beside ``target`` for a save's temporary file (``tmp``) or the replaced file (``old``)."""
    return target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.{suffix}")


def save_target(path: str | os.PathLike[str]) -> Path:
    """The regular file a save to ``path`` will replace or create (a symlink's target), or ``SaveTargetError``.

    Checks what can be checked without writing the target: it is absent or a regular file,
    its folder exists, and a file can be created there (a probe, removed at once).
    """
    path = Path(path)
    target = _resolved(path)
    folder = target.parent
    if not folder.is_dir():
        raise SaveTargetError("the folder to save into does not exist", expected="an existing folder",
                              found=repr(str(folder)), fix=f"create it first: mkdir -p {shlex.quote(str(folder))}")
    _check_sticky(target, folder)
    probe = temp_name(target, "tmp")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise SaveTargetError("cannot create a file in the folder to save into", expected="a writable folder",
                              found=f"{str(folder)!r}: {exc.strerror}",
                              fix="save into a folder you can write to") from exc
    return target


def _resolved(path: Path) -> Path:
    """``path`` itself when absent or a regular file; a symlink's final regular target; else refused."""
    try:
        link = stat.S_ISLNK(os.lstat(path).st_mode)
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise SaveTargetError("cannot save through a dangling symlink", expected="a regular file or a new name",
                                  found=f"{str(path)!r} points to {os.readlink(path)!r}, which does not exist",
                                  fix="remove the link, or create the file it points to") from None
        return path
    except OSError as exc:  # a symlink loop, a file where a folder is expected, no permission
        raise SaveTargetError("cannot save to this path", expected="a regular file or a new name",
                              found=f"{str(path)!r}: {exc.strerror}", fix="pass another path") from exc
    if stat.S_ISDIR(mode):
        raise SaveTargetError("cannot save a state over a folder", expected="a file path",
                              found=f"{str(path)!r} is a folder",
                              fix="pass a file name inside the folder, e.g. folder/chat.kvs")
    if not stat.S_ISREG(mode):
        raise SaveTargetError("cannot save over a file that is not a regular file", expected="a regular file or "
                              "a new name", found=f"{str(path)!r} is a {kind_of(mode)}",
                              fix="pass the path of a regular file; kvstate never replaces devices, FIFOs "
                              "or sockets")
    return Path(os.path.realpath(path)) if link else path


def _check_sticky(target: Path, folder: Path) -> None:
    """In a sticky folder (``/tmp``) only the owner may replace a file: say so now, not after the work."""
    try:
        owner, folder_st = os.stat(target).st_uid, os.stat(folder)
    except OSError:  # a new name; or the probe that follows will say what is wrong
        return
    me = os.geteuid()
    if folder_st.st_mode & stat.S_ISVTX and me not in (0, owner, folder_st.st_uid):
        raise SaveTargetError("cannot replace another user's file in a sticky folder", expected="a file you own",
                              found=f"{str(target)!r} belongs to uid {owner}", fix="save under another name")


def recheck(target: Path) -> None:
    """Just before the rename: the target is still absent or a regular file (not swapped for a device)."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):  # renaming over a link replaces the link only
        raise SaveTargetError("the save target changed into a special file during the save",
                              expected="a regular file", found=f"{str(target)!r} is a {kind_of(mode)}",
                              fix="pass the path of a regular file")


def clean_leftovers(target: Path) -> list[str]:
    """Delete the temporary and second names that killed saves to ``target`` left (their writer is
    dead and they are this user's regular files); returns the names deleted."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.[0-9a-f]{{8}}\.(?:tmp|old)")
    removed = []
    with contextlib.suppress(OSError), os.scandir(target.parent) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match and _is_orphan(entry, int(match.group(1))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def _is_orphan(entry: os.DirEntry[str], pid: int) -> bool:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and pid != os.getpid() and not _alive(pid)


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts); unprovable cases count as alive."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True


def max_input_bytes(value: int | None = None) -> int:
    """The size cap of input files: ``value``, else ``$KVSTATE_MAX_INPUT_BYTES``, else 64 MiB."""
    if value is not None:
        return value
    text = os.environ.get(MAX_INPUT_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_INPUT_BYTES
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        raise InputFileError(f"${MAX_INPUT_ENV} is not a positive number of bytes", expected="an integer >= 1",
                             found=repr(text), fix=f"unset it or set e.g. {MAX_INPUT_ENV}={DEFAULT_MAX_INPUT_BYTES}")
    return limit


def read_bounded(path: str | os.PathLike[str], limit: int, what: str = "input file") -> bytes:
    """The bytes of the regular file ``path`` (symlinks followed), refused past ``limit`` bytes."""
    try:  # O_NONBLOCK: a FIFO is refused below instead of blocking the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InputFileError(f"cannot open the {what}", found=f"{str(path)!r}: {exc.strerror}",
                             fix="check the path and its permissions") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError(f"the {what} is not a regular file", expected="a regular file",
                                 found=f"{str(path)!r} is a {kind_of(st.st_mode)}", fix="pass a regular file")
        raise _too_large(path, what, limit, f"{st.st_size} bytes")
    with os.fdopen(fd, "rb", buffering=0) as f:
        data = _read_at_most(f, limit + 1, path, what)
    if len(data) > limit:  # it grew, or reported a size it does not have
        raise _too_large(path, what, limit, f"more than {limit} bytes")
    return data


def _read_at_most(f: object, n: int, path: str | os.PathLike[str], what: str) -> bytes:
    chunks, got = [], 0
    while got < n:
        try:
            chunk = f.read(min(n - got, 2**20))  # type: ignore[attr-defined]
        except OSError as exc:
            raise InputFileError(f"cannot read the {what}", found=f"{str(path)!r}: {exc.strerror}",
                                 fix="check the file") from exc
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _too_large(path: str | os.PathLike[str], what: str, limit: int, found: str) -> InputFileError:
    return InputFileError(f"the {what} is larger than the input cap", expected=f"<= {limit} bytes",
                          found=f"{str(path)!r} has {found}",
                          fix=f"raise the cap with --max-input-bytes or ${MAX_INPUT_ENV}, or pass a smaller file")


def check_model_folder(folder: Path) -> None:
    """Every file of a model folder (symlinks followed) is a regular file, and its non-weight files
    (configs, tokenizers, read whole by transformers) are of a plausible size: a FIFO or a link to
    ``/dev/zero`` named ``tokenizer.json`` is refused instead of read forever."""
    for entry in sorted(folder.iterdir()):
        try:
            st = entry.stat()
        except OSError:
            continue  # a dangling link: transformers reports it if it needs the file
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError("a model folder holds a file that is not a regular file",
                                 expected="regular files", found=f"{str(entry)!r} is a {kind_of(st.st_mode)}",
                                 fix="remove it, or replace it with the real file")
        if st.st_size > MAX_MODEL_TEXT_BYTES and not entry.name.endswith(WEIGHT_SUFFIXES):
            raise InputFileError("a model folder's config or tokenizer file is implausibly large",
                                 expected=f"<= {MAX_MODEL_TEXT_BYTES} bytes", found=f"{str(entry)!r} has "
                                 f"{st.st_size} bytes", fix="check the folder; only weight files are that large")
