"""Every serve flag is honoured or refused with one line: no tracebacks, no silent defaults."""

import argparse

import pytest

from fovea.cli import build_parser, main
from fovea.cli_types import byte_size

GiB = 2**30


@pytest.mark.parametrize("flags, message", [
    (["--port", "0"], "argument --port: must be at least 1"),
    (["--port", "70000"], "must be a TCP port between 1 and 65535"),
    (["--max-queue", "0"], "argument --max-queue: must be at least 1"),
    (["--max-batch-size", "0"], "argument --max-batch-size: must be at least 1"),
    (["--max-batched-tokens", "-3"], "argument --max-batched-tokens: must be at least 1"),
    (["--max-image-bytes", "0"], "argument --max-image-bytes: must be at least 1 byte"),
    (["--max-image-pixels", "0"], "argument --max-image-pixels: must be at least 1"),
    (["--gpu-memory-utilization", "1.5"], "must be above 0 and at most 1"),
    (["--gpu-memory-utilization", "0"], "must be above 0 and at most 1"),
    (["--kv-cache-memory", "lots"], "'lots' is not a size"),
    (["--max-model-len", "0"], "argument --max-model-len: must be at least 1"),
    (["--canary-interval", "-1"], "must be 0 or more"),
    (["--max-video-bytes", "0"], "argument --max-video-bytes: must be at least 1 byte"),
    (["--max-video-frames", "0"], "argument --max-video-frames: must be at least 1"),
    (["--max-video-seconds", "0"], "must be a positive number of seconds"),
    (["--max-video-frame-pixels", "0"], "argument --max-video-frame-pixels: must be at least 1"),
])
def test_bad_values_are_refused_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_removed_simple_engine_is_refused_in_one_line(capsys):
    assert main(["serve", "--engine", "simple", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--engine simple was removed: fovea has one engine (paged)" in err and "Traceback" not in err


def test_a_max_model_len_past_the_models_context_is_refused(capsys):
    assert main(["serve", "--device", "cpu", "--no-canary", "--max-model-len", "999999"]) == 2
    err = capsys.readouterr().err
    assert "--max-model-len 999999 is longer than the model's context" in err and "Traceback" not in err


def test_flags_reach_the_settings_as_given():
    args = build_parser().parse_args(["serve", "--max-batch-size", "3", "--max-image-bytes", "1MiB",
                                      "--kv-cache-memory", "2GiB", "--gpu-memory-utilization", "0.45",
                                      "--max-model-len", "512"])
    assert (args.max_batch_size, args.max_image_bytes, args.kv_cache_memory) == (3, 2**20, 2 * GiB)
    assert (args.gpu_memory_utilization, args.max_model_len) == (0.45, 512)
    video = build_parser().parse_args(["serve", "--max-video-bytes", "1MiB", "--max-video-frames", "8",
                                       "--max-video-seconds", "30", "--max-video-frame-pixels", "640000"])
    assert (video.max_video_bytes, video.max_video_frames, video.max_video_seconds,
            video.max_video_frame_pixels) == (2**20, 8, 30.0, 640_000)


def test_sizes_read_binary_and_decimal_units():
    assert byte_size("1024") == 1024 and byte_size("16GiB") == byte_size("16G") == 16 * GiB
    assert byte_size("1.5 GB") == 1_500_000_000 and byte_size("512MiB") == 512 * 2**20
    for bad in ("", "12 parsecs", "-1GiB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_the_server_settings_reach_the_paged_engine(demo_model):
    from fovea.config import ServerSettings
    from fovea.serve.app import create_app

    settings = ServerSettings(device="cpu", dtype="float32", canary=False, kv_cache_memory=8 * 2**20,
                              max_model_len=256, max_batch_size=3)
    engine = create_app(settings, loaded=demo_model).state.fovea.engine
    assert engine.config.max_model_len == 256 and engine.config.max_num_seqs == 3
    assert engine.runner.memory_plan.line("kv_cache").how.startswith(f"{8 * 2**20 // engine.runner.kv_plan.bytes_per_block} blocks")
    assert "--kv-cache-memory" in engine.runner.memory_plan.line("kv_cache").how


def test_a_gpu_share_on_a_cpu_device_is_refused_not_ignored(demo_model):
    from fovea.config import ServerSettings
    from fovea.engine.memory.plan import MemoryPlanError
    from fovea.serve.app import create_app

    with pytest.raises(MemoryPlanError, match="--gpu-memory-utilization applies to a GPU") as err:
        create_app(ServerSettings(device="cpu", canary=False, gpu_memory_utilization=0.5), loaded=demo_model)
    assert "--kv-cache-memory" in err.value.message


def test_encode_worker_flags_without_e_pd_are_refused_not_ignored(capsys):
    assert main(["serve", "--device", "cpu", "--no-canary", "--encode-workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "they need --topology e_pd" in err and "Traceback" not in err
