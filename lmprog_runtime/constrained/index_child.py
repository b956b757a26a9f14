"""The child process of `index_process.py`: builds outlines-core indexes, one request at a
time, and sends each back pickled.

Run as a script (`python index_child.py`), so that it imports only outlines-core, not the
runtime (torch). Frames on stdin and stdout are an 8-byte length, then a pickle: first the
vocabulary, then one regex per request, each answered `("ok", index, resident MiB)` or
`("error", message, resident MiB)`. It ends when stdin closes, or when its parent is gone.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import threading
import time

HEADER = struct.Struct("<Q")


def read_frame(fd: int) -> object | None:
    """The next frame's object from `fd`, or None at its end."""
    sized = read_sized_frame(fd)
    return None if sized is None else sized[0]


def read_sized_frame(fd: int) -> tuple[object, int] | None:
    """The next frame's object from `fd` and the size of its pickle in bytes (an index
    holds about twice that in memory), or None at its end."""
    header = read_exactly(fd, HEADER.size)
    if header is None:
        return None
    body = read_exactly(fd, HEADER.unpack(header)[0])
    return None if body is None else (pickle.loads(body), len(body))


def read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_frame(fd: int, value: object) -> None:
    write_pickled(fd, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def write_pickled(fd: int, body: bytes) -> None:
    data = memoryview(HEADER.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data) :]


def _exit_with_parent(parent: int) -> None:
    """End this process once its parent is gone (a compile may run for hours)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main() -> None:
    from outlines_core import Index

    stdin, stdout = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # (what a library prints stays out)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    vocabulary = read_frame(stdin)
    while (regex := read_frame(stdin)) is not None:
        try:
            status, value = "ok", Index(regex, vocabulary)
        except BaseException as error:  # noqa: BLE001 - outlines-core panics are BaseException
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            status, value = "error", str(error) or type(error).__name__
        write_frame(stdout, (status, value, resident_mib()))


def resident_mib() -> float:
    """This process's resident memory in MiB (0 where /proc cannot tell)."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 1024


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))  # (its modules must shadow none)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    main()
