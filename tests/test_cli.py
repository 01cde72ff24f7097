import random
import subprocess
import sys

from fovea.demo import scenes


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fovea.cli", *args], capture_output=True, text=True, timeout=300)


def test_chat_prints_the_answer(tmp_path):
    scene = scenes.SceneSampler().sample(random.Random(77_001))
    path = tmp_path / "scene.png"
    scenes.render(scene).save(path)
    result = run_cli("chat", "--image", str(path), "Describe the image.")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == scenes.describe_answer(scene)


def test_chat_refuses_a_broken_image_and_a_bad_model_dir(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    result = run_cli("chat", "--image", str(broken), "Describe the image.")
    assert result.returncode == 2 and "error" in result.stderr.lower()
    result = run_cli("chat", "--model", str(tmp_path), "--image", str(broken), "hi")
    assert result.returncode == 2 and "config.json is missing" in result.stderr
