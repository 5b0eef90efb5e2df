"""Hostile faces of the command line: a native panic, an empty API key, a port in use, a mistyped
model name, another user's Ray cluster on the host, a Ray address where nothing listens.

Each ends as one ``sluice: error:`` line (or the right choice) without a traceback and without
waiting minutes; real subprocesses, sockets and processes throughout.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from sluice import cli
from sluice.cluster.connect import own_clusters, wait_listening
from sluice.cluster.errors import ClusterError
from sluice.resolve import ModelNotFoundError, resolve_model

SLUICE = [sys.executable, "-m", "sluice.cli"]


def _panic_class():
    """A class shaped as pyo3's (a BaseException, not an Exception, from module ``pyo3_runtime``)."""
    return type("PanicException", (BaseException,), {"__module__": "pyo3_runtime"})


def test_native_panic_is_one_error_line(monkeypatch, capsys):
    panic = _panic_class()

    def boom(args):
        raise panic("called `Option::unwrap()` on a `None` value\nat src/lib.rs:12")

    monkeypatch.setattr(cli, "cmd_inspect", boom)
    assert cli.main(["inspect", "demo"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sluice: error: a native library failed (pyo3_runtime."
                                                   "PanicException: called `Option::unwrap()` on a `None` value at")
    with pytest.raises(panic):  # --debug shows it, traceback and all
        cli.main(["inspect", "demo", "--debug"])


@pytest.mark.parametrize("exc, code", [(KeyboardInterrupt, 130), (SystemExit, None)])
def test_interrupt_and_exit_keep_their_behaviour(monkeypatch, capsys, exc, code):
    def stop(args):
        raise exc()

    monkeypatch.setattr(cli, "cmd_inspect", stop)
    if code is None:
        with pytest.raises(SystemExit):
            cli.main(["inspect", "demo"])
    else:
        assert cli.main(["inspect", "demo"]) == code
        assert "interrupted" in capsys.readouterr().err


def test_serve_refuses_an_empty_api_key():
    for env, args in ((os.environ, ["--api-key", ""]), (dict(os.environ, SLUICE_API_KEY=" \t"), [])):
        out = subprocess.run([*SLUICE, "serve", "demo", "--port", "1", *args], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 2 and out.stderr == ("sluice: error: --api-key (or SLUICE_API_KEY) is empty: give "
                                                      "a key, or unset it to serve without one\n"), out.stderr


def test_service_refuses_an_empty_api_key():
    pytest.importorskip("fastapi")
    from sluice.errors import InvalidArgumentError
    from sluice.server.bind import check_api_key

    for key in ("", " ", " padded "):
        with pytest.raises(InvalidArgumentError, match="--api-key"):
            check_api_key(key)
    assert check_api_key(None) is None and check_api_key("k3y") == "k3y"


def test_serve_on_a_port_in_use_is_one_line_and_nothing_announced():
    pytest.importorskip("uvicorn")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run([*SLUICE, "serve", "demo", "--port", str(port)], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1
    assert out.stderr == (f"sluice: error: cannot serve on 127.0.0.1:{port}: the port is in use by another "
                          "process (choose another with --port)\n")
    assert time.monotonic() - t0 < 30  # refused before the model was loaded


def test_mistyped_demo_suggests_demo_not_a_download(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()
    for name, close in (("dmeo", "'demo'"), ("demoo", "'demo'"), ("my-modle", "'my-model'")):
        with pytest.raises(ModelNotFoundError) as e:
            resolve_model(name, cache_dir=tmp_path / "hub")
        assert f"did you mean {close}?" in str(e.value) and "hf download" not in str(e.value)
    assert cli.main(["run", "dmeo", "-p", "x"]) == 1
    err = capsys.readouterr().err
    assert "did you mean 'demo'?" in err and "hf download" not in err and err.count("\n") == 1
    with pytest.raises(ModelNotFoundError, match=r"fetch it with: hf download someone/dmeo$"):
        resolve_model("someone/dmeo", cache_dir=tmp_path / "hub")  # shaped like a repo id: the download
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("zzqx", cache_dir=tmp_path / "hub")
    assert "did you mean" not in str(e.value)


def _fake_raylet(bindir, gcs: str, user: int | None):
    """A process named ``raylet`` with a raylet's ``--gcs-address`` flag (as ``ps`` shows one), run
    as ``user`` (a uid) when given: a copy of the shell under that name."""
    exe = bindir / "raylet"
    if not exe.exists():
        shutil.copy("/bin/sh", exe)
        os.chmod(exe, 0o755)

    def drop():
        if user is not None:
            os.setgid(user)
            os.setuid(user)

    return subprocess.Popen([str(exe), "-c", "sleep 60; :", "raylet", f"--gcs-address={gcs}",
                             "--node_ip_address=127.0.0.1"], preexec_fn=drop, env={"PATH": "/bin:/usr/bin"})


@pytest.mark.skipif(not os.path.isdir("/proc") or not os.path.exists("/bin/sh"), reason="Linux /proc and /bin/sh")
def test_ray_auto_never_joins_another_users_cluster():
    import tempfile

    bindir = tempfile.mkdtemp(prefix="sluice-raylet-")
    os.chmod(bindir, 0o755)  # the other user can run the copy
    from pathlib import Path

    bindir = Path(bindir)
    procs = [_fake_raylet(bindir, "127.0.0.1:47001", None)]
    other = 65534 if os.geteuid() == 0 else None  # nobody: only root can run a process as another user
    if other is not None:
        procs.append(_fake_raylet(bindir, "127.0.0.1:47002", other))
    try:
        time.sleep(0.3)
        found = own_clusters()
        assert "127.0.0.1:47001" in found
        assert "127.0.0.1:47002" not in found  # another user's raylet is never picked
        if other is not None:
            assert procs[1].poll() is None, "the other user's process did not start"
            assert os.stat(f"/proc/{procs[1].pid}").st_uid == other
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(bindir, ignore_errors=True)


def test_ray_address_with_nothing_listening_waits_bounded_with_progress(monkeypatch):
    from sluice.cluster import connect

    monkeypatch.setattr(connect, "PROGRESS_EVERY_S", 0.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        said: list[str] = []
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=rf"--ray 127\.0\.0\.1:{port}: nothing is listening there \(connection "
                                               rf"refused\) for 2 s \(--ray-timeout\): no Ray cluster is running"):
            wait_listening(f"127.0.0.1:{port}", 2.0, say=said.append)
        assert 1.5 < time.monotonic() - t0 < 6
        assert said and all(line.startswith(f"sluice: waiting for a Ray cluster at 127.0.0.1:{port}") for line in said)
    with pytest.raises(ClusterError, match="not an address"):
        wait_listening("no-port-here", 1.0)


def test_prompt_beyond_the_models_own_limit_names_it_before_loading(tmp_path, capsys, monkeypatch):
    """The demo model's max_position_embeddings is 512: a longer prompt is refused naming that limit
    (never "raise --max-context"), on the command line before any weights load."""
    import sluice

    long = tmp_path / "long.txt"
    long.write_text("def f(x):\n    return x\n" * 200)
    monkeypatch.setattr(sluice, "load", lambda *a, **k: pytest.fail("the weights were loaded"))
    for extra in ([], ["--max-context", "100"], ["--max-context", "512"]):
        assert cli.main(["run", "demo", "--prompt-file", str(long), *extra]) == 2
        err = capsys.readouterr().err
        assert "the model's own limit of 512 positions (max_position_embeddings" in err, err
        assert "raise --max-context" not in err and err.count("\n") == 1
    mid = tmp_path / "mid.txt"
    mid.write_text("def f(x): return x " * 20)
    assert cli.main(["run", "demo", "--prompt-file", str(mid), "--max-context", "20"]) == 2
    assert "(raise --max-context (the model allows up to 512) or shorten the prompt)" in capsys.readouterr().err


def test_engine_names_the_models_limit_for_token_ids():
    import sluice
    from sluice.errors import InvalidArgumentError

    with sluice.load("demo", "2GiB", progress=False, max_context=512) as eng:
        with pytest.raises(InvalidArgumentError, match=r"prompt of 600 tokens does not fit the model's own limit "
                                                       r"of 512 positions"):
            eng.generate([5] * 600, max_new_tokens=1)
        with pytest.raises(InvalidArgumentError, match=r"prompt of 512 tokens does not fit the model's own limit"):
            eng.generate([5] * 512, max_new_tokens=1)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_ray_timeout_must_be_a_positive_number(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["run", "demo", "--ray", "auto", "--ray-timeout", value])
    assert e.value.code == 2 and "argument --ray-timeout" in capsys.readouterr().err


def test_ray_timeout_api_option_is_checked():
    import sluice
    from sluice.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="ray_timeout"):
        sluice.load("demo", "2GiB", progress=False, ray="auto", ray_timeout=0)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_ray_compiled_api_option_is_a_bool(value):
    """Checked before any cluster is reached."""
    import sluice
    from sluice.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="ray_compiled"):
        sluice.load("demo", "2GiB", progress=False, ray="auto", ray_compiled=value)
