"""A GGUF file's counts and offsets checked against the file, as llama.cpp checks them.

`gguf.GGUFReader` trusts the header: an array count of 2**40 made it read on past the end
of the file, appending empty values until the process ran out of memory, and a tensor whose
offset or type was damaged was read from the wrong bytes (NaN logits, or another tensor's
weights). `check_header` walks the header before the reader parses it, bounding every
count and length by the bytes left; `check_tensor_layout` requires what llama.cpp requires
of the data section: the tensors in the order of the table, each starting where the one
before ended (padded to the alignment), the last one inside the file.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

# GGUF value types: fixed sizes, strings (u64 length + bytes) and arrays (u32 type + u64
# count + items).
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MIN_SIZES = {**_FIXED_SIZES, _STRING: 8, _ARRAY: 12}  # the least bytes one value takes
_MAX_DIMS = 4  # GGML_MAX_DIMS


def check_header(path: Path) -> None:
    """ValueError where a count, length or type in `path`'s header is impossible: it would
    reach past the end of the file (a corrupt or truncated file)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            _Walk(data, path).header()
        except RecursionError:  # (arrays of arrays, thousands deep)
            raise ValueError(f"{path} is a corrupt GGUF file: its arrays nest too deep") from None


def check_tensor_layout(reader: Any, path: Path) -> None:
    """ValueError unless the tensors lie one after another in the data section, in table
    order, each padded to the file's alignment, and all inside the file."""
    expected = 0
    end = reader.data_offset
    for t in reader.tensors:
        offset = t.data_offset - reader.data_offset
        if offset != expected:
            raise ValueError(
                f"{path}: tensor {t.name!r} starts at byte {offset} of the data section, "
                f"expected {expected} (after the tensor before it, padded to "
                f"{reader.alignment}): a corrupt tensor table (its offset or a type)"
            )
        end = reader.data_offset + offset + t.n_bytes
        expected += -(-t.n_bytes // reader.alignment) * reader.alignment
    if end > len(reader.data):
        raise ValueError(
            f"{path} is a truncated GGUF file: its tensors end at byte {end}, the file at "
            f"{len(reader.data)}"
        )


class _Walk:
    """A cursor over the header, refusing whatever reaches past the end."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.pos = data, path, 8  # (past the magic and version)

    def header(self) -> None:
        num_tensors, num_kv = self.u64("the tensor count"), self.u64("the metadata count")
        self.bound(num_kv, 8 + 4 + 1, "the metadata count")
        for i in range(num_kv):
            key = self.string(f"metadata key {i}")
            self.value(self.u32(f"the type of metadata {key!r}"), f"metadata {key!r}")
        self.bound(num_tensors, 8 + 4 + 4 + 8, "the tensor count")
        for i in range(num_tensors):
            name = self.string(f"tensor {i}'s name")
            num_dims = self.u32(f"tensor {name!r}'s number of dimensions")
            if num_dims > _MAX_DIMS:
                self.fail(f"tensor {name!r} has {num_dims} dimensions (at most {_MAX_DIMS})")
            self.skip(8 * num_dims + 4 + 8, f"tensor {name!r}'s shape, type and offset")

    def value(self, kind: int, what: str) -> None:
        if kind in _FIXED_SIZES:
            self.skip(_FIXED_SIZES[kind], what)
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY:
            item = self.u32(f"{what}'s item type")
            if item not in _MIN_SIZES:
                self.fail(f"{what} is an array of unknown type {item}")
            count = self.u64(f"{what} (its length)")
            self.bound(count, _MIN_SIZES[item], f"{what}, an array")
            if item in _FIXED_SIZES:
                self.skip(count * _FIXED_SIZES[item], what)
            else:
                for _ in range(count):
                    self.value(item, what)
        else:
            self.fail(f"{what} has unknown value type {kind}")

    def string(self, what: str) -> str:
        length = self.u64(f"{what} (its length)")
        start = self.pos
        self.skip(length, what)
        return bytes(self.data[start : start + min(length, 200)]).decode("utf-8", "replace")

    def u32(self, what: str) -> int:
        return self.integer(4, what)

    def u64(self, what: str) -> int:
        return self.integer(8, what)

    def integer(self, size: int, what: str) -> int:
        start = self.pos
        self.skip(size, what)
        return int.from_bytes(self.data[start : self.pos], "little")

    def bound(self, count: int, least: int, what: str) -> None:
        """`count` values of at least `least` bytes each must fit in what is left."""
        if count * least > len(self.data) - self.pos:
            left = len(self.data) - self.pos
            self.fail(f"{what} of {count} items, more than the {left} bytes left can hold")

    def skip(self, size: int, what: str) -> None:
        if self.pos + size > len(self.data):
            self.fail(f"{what} reaches past the end of the file")
        self.pos += size

    def fail(self, why: str) -> None:
        raise ValueError(f"{self.path} is a truncated or corrupt GGUF file: {why}")
