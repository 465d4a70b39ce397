"""engine/kernels/kernel_build.py: the CPU kernel's build started early is waited for, never run twice, and its
failure is reported by the call that needs the kernel. A stand-in compiler records its calls (the real
build is covered by test_attention.py)."""

from __future__ import annotations

import stat
import threading

import pytest

from engine.device import compile_cache

from engine.kernels import kernel_build
COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "stand-in 1.0"; exit 0; fi
echo compile >> "{log}"
sleep 0.5
if [ -n "$FAIL_BUILD" ]; then echo "stand-in: error: no" >&2; exit 1; fi
while [ "$#" -gt 0 ]; do if [ "$1" = "-o" ]; then echo built > "$2"; fi; shift; done
"""


@pytest.fixture
def compiler(tmp_path, monkeypatch):
    log = tmp_path / "compiles.log"
    path = tmp_path / "cxx"
    path.write_text(COMPILER.format(log=log))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(path))
    monkeypatch.setattr(kernel_build, "_builds", {})
    monkeypatch.setattr(kernel_build, "_temp_dir", [])
    return lambda: len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.parametrize("cache", ["dir", "off"])
def test_build_waits_for_the_build_start_began(cache, compiler, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "directory", lambda: str(tmp_path / "cache") if cache == "dir" else None)
    kernel_build.start()
    threads = [t for t in threading.enumerate() if t.name == "pagefleet-kernel-build"]
    assert threads, "start() did not build in the background"
    library = kernel_build.build()
    assert library.read_text() == "built\n" and compiler() == 1
    if cache == "dir":
        assert library.parent == tmp_path / "cache" / "kernels"
    else:  # one temporary directory for the process, not one per call
        assert library.parent.name.startswith(kernel_build.TEMP_PREFIX)
    assert kernel_build.build() == library and compiler() == 1
    kernel_build.start()  # already built: nothing to do
    assert compiler() == 1
    assert not [p for p in library.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_background_build_is_reported_then_retried(compiler, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "directory", lambda: str(tmp_path / "cache"))
    monkeypatch.setenv("FAIL_BUILD", "1")
    kernel_build.start()  # never raises
    with pytest.raises(kernel_build.KernelUnavailable, match="stand-in: error: no"):
        kernel_build.build()
    assert compiler() == 1
    monkeypatch.delenv("FAIL_BUILD")
    assert kernel_build.build().exists() and compiler() == 2
    assert not list((tmp_path / "cache" / "kernels").glob(".*.tmp"))


@pytest.mark.parametrize("platforms, cpu", [("cpu", True), ("cpu,tpu", True), ("tpu", False), ("cuda,cpu", False)])
def test_cpu_only_follows_jax_platforms(platforms, cpu, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert kernel_build.backend_is_cpu_only() is cpu


def test_setup_command_never_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert kernel_build.main() == 0
    assert "cannot be built" in capsys.readouterr().err
