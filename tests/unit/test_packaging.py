"""The wheel holds what an installed lmprog reads from its own files: the native kernels'
C++ sources (once beside the package, in no wheel: installed copies ran the torch backend),
the built-in models' corpus and the type markers; and the native build finds the `ninja`
that the `ninja` package installs beside the interpreter, where PATH has none."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lmprog_runtime import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The files of a wheel built from a copy of the package sources (a build in the
    checkout would leave its `build/` there)."""
    tree = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for package in ("lmprog", "lmprog_runtime"):
        shutil.copytree(ROOT / package, tree / package, ignore=ignore)
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, tree / file)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*command, "-w", str(out), str(tree)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("lmprog-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_the_wheel_holds_the_native_sources_where_the_build_reads_them(wheel_names):
    assert native.csrc_dir() == Path(native.__file__).resolve().parent / "csrc"
    for name in native._SOURCES + native._HEADERS:
        assert (native.csrc_dir() / name).is_file()
        assert f"lmprog_runtime/csrc/{name}" in wheel_names
    assert {"lmprog/py.typed", "lmprog_runtime/py.typed"} <= wheel_names
    corpus = {f"lmprog_runtime/data/{p.name}" for p in (ROOT / "lmprog_runtime/data").glob("*")}
    assert corpus and corpus <= wheel_names


def test_the_build_finds_the_ninja_beside_the_interpreter(tmp_path, monkeypatch):
    scripts = tmp_path / "venv-bin"
    scripts.mkdir()
    (scripts / "ninja").write_text("#!/bin/sh\n")
    (scripts / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(scripts / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with native._ninja_on_path():
        assert shutil.which("ninja") == str(scripts / "ninja")
    assert os.environ["PATH"] == str(tmp_path / "empty")  # (as it was, after the build)
    monkeypatch.setenv("PATH", str(scripts))  # a ninja on PATH already: left alone
    with native._ninja_on_path():
        assert os.environ["PATH"] == str(scripts)
