"""The wheel is enough: built with ``python -m build``, installed into a fresh virtual environment
and run from an empty directory, ``fovea serve`` serves the demo model it carries.

Reusing dependencies, honestly: the fresh venv gets the wheel as its *only* copy of fovea, and
for its dependencies one ``.pth`` line naming this interpreter's site-packages, so torch is not
downloaded again (minutes on CI). A plain path line in a ``.pth`` file does not run the ``.pth``
files inside that directory, so the editable install of the checkout there stays inert; the test
asserts that ``fovea`` is imported from the venv's own site-packages, that pip installed it there,
and that ``pip check`` finds every declared dependency satisfied.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from fovea.demo import scenes

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("build", reason="the test extra installs 'build'")


def source_files() -> list[str]:
    """What a clean clone holds: tracked files plus new ones git does not ignore."""
    if shutil.which("git") and (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, check=True, capture_output=True).stdout
        return [p for p in out.decode().split("\0") if p and (ROOT / p).exists()]
    pytest.skip("needs a git checkout to know which files are sources")


def copy_sources(dest: Path) -> None:
    # A copy, so that the build's egg-info and build/ never touch the checkout (a stale
    # SOURCES.txt there would leak into the sdist).
    for rel in source_files():
        src, dst = ROOT / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif src.is_file():
            shutil.copy2(src, dst)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"fovea serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                return json.load(reply)
        except OSError:
            time.sleep(0.25)
    raise AssertionError(f"fovea serve did not answer /health in {timeout} s:\n{log.read_text()}")


def test_wheel_serves_the_demo_model_from_an_empty_directory(tmp_path: Path) -> None:
    tree, dist, venv, empty = (tmp_path / n for n in ("tree", "dist", "venv", "empty"))
    copy_sources(tree)
    # --no-isolation: build with this environment's setuptools (the test extra pins it) instead of
    # downloading one; the sdist is built first and the wheel from it, as for a release.
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(tree)])
    wheel = next(dist.glob("fovea-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "fovea/demo_model/fovea-shapes/model.safetensors" in names
    assert "fovea/serve/playground/index.html" in names
    assert not any(n.startswith(("tests/", "models/")) for n in names)

    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    (site / "_fovea_test_reuse_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --no-index: nothing may be downloaded; --force-reinstall --no-deps: the checkout's editable
    # fovea is visible through the .pth, and pip would otherwise call the wheel already installed.
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-deps",
         "--force-reinstall", "--no-warn-conflicts", str(wheel)])
    run([sys.executable, "-m", "pip", "--python", str(python), "check"])

    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    probe = "import fovea, fovea.loading.loader as l; print(fovea.__file__); print(l.default_model_dir())"
    where = run([str(python), "-c", probe], cwd=empty, env=env).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where

    port = _free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(venv / "bin" / "fovea"), "serve", "--port", str(port), "--device", "cpu",
                                 "--canary-interval", "0"], cwd=empty, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        health = wait_ready(base, proc, log)
        assert health["model"] == "fovea-shapes" and health["status"] == "ok", health
        assert health["canary"]["ok"], health["canary"]
        scene = scenes.SceneSampler().sample(random.Random(20_261_201))
        answer = _ask(base, scenes.render(scene), "How many shapes are there?")
        assert answer in ("one", "two", "three"), answer
        with urllib.request.urlopen(base + "/", timeout=5) as page:
            assert page.headers["content-type"].startswith("text/html")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert list(empty.iterdir()) == [], "fovea serve wrote into the working directory"


def _ask(base: str, image, question: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = {"model": "fovea-shapes", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}]}
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)["choices"][0]["message"]["content"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
