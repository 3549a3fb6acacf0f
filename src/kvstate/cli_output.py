"""How the ``kvstate`` command prints what goes wrong: every error and every kvstate warning on one line.

``kvstate: error: ...`` names the fix (exit code 2 for a user's mistake, 1 for an unexpected failure);
``--verbose`` adds what was expected and what was found, a line each. kvstate's own warnings
(``ScheduleWarning``, ``StoreWarning``) print as ``kvstate: warning: ...``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


class UserError(Exception):
    """A mistake on the command line: printed as one line with its ``fix``, exit code 2."""

    def __init__(self, message: str, *, fix: str) -> None:
        super().__init__(f"{message}; fix: {fix}")


def one_line(text: str) -> str:
    """``text`` with newlines and other control characters escaped, so an error stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@contextlib.contextmanager
def warnings_in_one_line() -> Iterator[None]:
    """kvstate's own warnings (``ScheduleWarning``, ``StoreWarning``) as one line each, ``kvstate: warning: ...``,
    like errors; others as Python prints them. Restored on the way out."""
    import warnings

    from .errors import ScheduleWarning, StoreWarning

    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, (ScheduleWarning, StoreWarning)):
                text = one_line(str(message)).removeprefix("kvstate: ")
                print(f"kvstate: warning: {text}", file=sys.stderr)
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield


LINE = 400  # characters of an error's one line before details are left out (all of them are behind --verbose)


def error_text(exc: Exception, verbose: bool) -> str:
    """``kvstate: error: ...`` for ``exc``: one line, with the fix; with ``verbose`` every detail, a line each."""
    from .errors import KVStateError

    name = "" if isinstance(exc, UserError) else f"{type(exc).__name__}: "
    if not isinstance(exc, KVStateError):
        text = one_line(f"{name}{exc}")
        if verbose or len(text) <= LINE:
            return f"kvstate: error: {text}" + ("" if verbose or isinstance(exc, UserError) else
                                                " (--verbose for the traceback)")
        return f"kvstate: error: {text[:LINE]}... (--verbose for the whole message)"
    message = getattr(exc, "message", str(exc))  # an error unpickled from a child process has only its text
    if verbose:
        details = [("expected", exc.expected), ("found", exc.found), ("fix", exc.fix)]
        return "\n".join([f"kvstate: error: {one_line(name + message)}",
                          *(f"  {key}: {one_line(str(value))}" for key, value in details if value is not None)])
    whole = one_line(f"{name}{exc}")
    if len(whole) <= LINE:
        return f"kvstate: error: {whole}"
    head, fix = one_line(name + message), f"; fix: {one_line(exc.fix)}" if exc.fix else ""
    room = LINE - len(head) - len(fix) - len("; found: ")  # the fix stays whole; what was found gets the rest
    found = one_line(str(exc.found)) if exc.found is not None else ""
    found = f"; found: {found if len(found) <= room else found[:room] + '...'}" if found and room >= 40 else ""
    return f"kvstate: error: {head}{found}{fix} (--verbose: the whole error)"
