"""fovea's command line: serve | chat | doctor | eval-demo | train-demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from fovea.cli_types import byte_size, fraction, json_object, port, positive_int
from fovea.errors import FoveaError
from fovea.logs import FORMATS, LEVELS


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="local Hugging Face-format model directory (default: the shipped demo model)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when a GPU is visible, else CPU), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), float32, float16, bfloat16")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="auto: the directory's weights (bf16, or the quantized format its config.json names: "
                             "compressed-tensors FP8/W4A16, fine-grained FP8, AWQ); dummy: random weights of its "
                             "shapes and format made on the device, for benchmarks and capacity planning")


def _non_negative_int(text: str) -> int:
    try:
        return 0 if text.strip() == "0" else positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}") from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = _non_negative_float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _workers(text: str) -> int:
    return 0 if text == "auto" else _non_negative_int(text)


def _memory_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                        help="share of the GPU's total memory this process may hold (default 0.9); on a GPU "
                             "that others use, what is free limits it further (docs/memory.md)")
    parser.add_argument("--kv-cache-memory", type=byte_size, default=None,
                        help="exact KV-cache size, e.g. 40GiB, instead of what --gpu-memory-utilization leaves")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest sequence (prompt + answer) served (default: the model's context length)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fovea", description="Serve vision-language models; never ignore the image.")
    parser.add_argument("--log-level", type=str.lower, choices=LEVELS, default=os.environ.get("FOVEA_LOG_LEVEL", "info"),
                        help="(env FOVEA_LOG_LEVEL; put it before the command: fovea --log-level debug serve)")
    parser.add_argument("--log-format", choices=FORMATS, default=os.environ.get("FOVEA_LOG_FORMAT", "text"),
                        help="text, or json: one object a line with request_id on every line a request causes "
                             "(env FOVEA_LOG_FORMAT; docs/operations.md)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory name)")
    # Kept so that scripts passing `--engine paged` still start; there is one engine.
    serve.add_argument("--engine", default="paged", help=argparse.SUPPRESS)
    serve.add_argument("--topology", choices=["agg", "e_pd"], default="agg",
                       help="agg: one process runs everything; e_pd: the vision stage in encode-worker processes "
                            "that load only the vision weights (docs/disaggregation.md)")
    serve.add_argument("--engine-core", choices=["thread", "process"], default="process",
                       help="process: the engine (model, scheduler, KV cache, vision stage) in a process of its own, "
                            "so HTTP, media and tokenisation never wait on it for the GIL; thread: in this process "
                            "(docs/architecture.md)")
    serve.add_argument("--api-server-count", type=positive_int, default=1,
                       help="API processes sharing the port (HTTP, media, templates, tokenisation), all feeding "
                            "the one engine core: for preprocessing-heavy loads (needs --engine-core process)")
    serve.add_argument("--encode-workers", type=positive_int, default=None,
                       help="e_pd: encode-worker processes (default 1)")
    serve.add_argument("--encode-device", default=None,
                       help="e_pd: the encode workers' device, e.g. cuda:1 while --device is cuda:0 (default: "
                            "--device); the rows cross through pinned host memory, checksummed")
    serve.add_argument("--ray-address", default=None,
                       help="run the encode workers (e_pd), and with --pd-workers the PD workers too, as actors "
                            "on this Ray cluster (host:port, 'auto' for this machine's cluster, or 'local' to "
                            "start one here); default: processes on this machine (docs/operations.md)")
    serve.add_argument("--pd-workers", type=positive_int, default=None,
                       help="prefill/decode workers (agg: data-parallel replicas), each with its own engine; this "
                            "process then loads no model and is their front: it routes requests to them and runs "
                            "the encode workers they share (docs/disaggregation.md)")
    serve.add_argument("--ray-pd-resources", type=json_object, default=None,
                       help='--ray-address with --pd-workers: what each PD worker\'s actor asks Ray for, e.g. '
                            '\'{"GPU": 1, "fovea_pd": 1}\' (default: {"CPU": 1, "GPU": 1} on GPUs, {"CPU": 1} '
                            "on CPU)")
    serve.add_argument("--ray-encode-resources", type=json_object, default=None,
                       help='--ray-address with --pd-workers in e_pd: what each encode worker\'s actor asks for '
                            '(default: {"CPU": 1, "GPU": 0.01} on GPUs, {"CPU": 1} on CPU)')
    serve.add_argument("--pd-timeout", type=float, default=None,
                       help="--pd-workers: seconds a PD worker may leave /health unanswered before the front "
                            "kills and restarts it, failing its requests with pd_worker_lost (default 30)")
    # A PD worker behind a front: started by the front alone, with these and its keys in the environment.
    serve.add_argument("--internal-pd-worker", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--internal-encode-socket", action="append", default=[], help=argparse.SUPPRESS)
    serve.add_argument("--encode-timeout", type=float, default=None,
                       help="e_pd: seconds an encode worker may hold a batch before it is restarted (default 60)")
    serve.add_argument("--vision-batch-size", type=positive_int, default=None,
                       help="images per vision forward (default 8); e_pd: the batch each encode worker "
                            "measures its memory peak for, and the most images the pool sends it at once")
    serve.add_argument("--max-batch-size", type=positive_int, default=None,
                       help="sequences decoded together (default: 256 on GPU, 16 on CPU)")
    serve.add_argument("--max-batched-tokens", type=positive_int, default=None,
                       help="paged engine: tokens one step may compute, prefill chunks and decodes together "
                            "(default: 8192 on GPU, 512 on CPU); larger speeds up bursts, smaller evens out "
                            "the gaps between streamed tokens")
    serve.add_argument("--step-overlap", choices=["auto", "on", "off"], default="auto",
                       help="paged engine: queue each step before reading the last one's tokens (auto: on a "
                            "GPU for models of 1 B parameters or more, whose steps outlast the host's work)")
    serve.add_argument("--fused-vision", choices=["auto", "on", "off"], default="auto",
                       help="paged engine: the vision stage through fovea's fused kernels instead of "
                            "transformers' modules (auto: as --step-overlap)")
    _memory_args(serve)
    serve.add_argument("--preprocess-workers", type=_workers, default=None,
                       help="processes that decode images and run the model's processor (default 0: the "
                            "server's threads, measured faster on an H200 machine; docs/benchmarks.md)")
    serve.add_argument("--decode-memory", type=byte_size, default=None,
                       help="memory that decodes of images over 4 megapixels may take together (default 512MiB); "
                            "larger ones wait, small images never do")
    serve.add_argument("--exact-image-resize", action="store_true",
                       help="give the processor every pixel of large images (default: images four times the "
                            "model's input are reduced to about twice it first, JPEGs while decoding)")
    serve.add_argument("--max-queue", type=positive_int, default=None,
                       help="waiting requests beyond this get 429 with Retry-After before any response starts "
                            "(default: no limit, as in vLLM)")
    serve.add_argument("--limit-images-per-prompt", type=_non_negative_int, default=4)
    serve.add_argument("--max-body-bytes", type=byte_size, default=32 * 1024 * 1024)
    serve.add_argument("--api-key", default=os.environ.get("FOVEA_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every route but /health (env FOVEA_API_KEY)")
    serve.add_argument("--allowed-media-dir", action="append", default=[], type=Path,
                       help="allow file:// image URLs under this directory (repeatable)")
    serve.add_argument("--allowed-media-domains", action="append", default=[],
                       help="allow http(s) image URLs from this host (repeatable; off by default)")
    serve.add_argument("--allow-private-media-addresses", action="store_true",
                       help="let allowed media hosts resolve to loopback/private addresses")
    serve.add_argument("--processor-override", type=json.loads, default={},
                       help='JSON fields to change in the image processor, e.g. \'{"resample": 2}\'')
    serve.add_argument("--force-processor-override", action="store_true",
                       help="allow an override that changes normalisation (reported in /health)")
    serve.add_argument("--canary-interval", type=_non_negative_float, default=600.0,
                       help="seconds between grounding-canary runs (0: only at start-up)")
    serve.add_argument("--no-canary", action="store_true", help="skip the grounding canary")
    serve.add_argument("--strict", action="store_true",
                       help="refuse to start if the canary fails; /health answers 503 while degraded")
    serve.add_argument("--max-image-bytes", type=byte_size, default=None,
                       help="largest encoded image accepted (default 20 MiB)")
    serve.add_argument("--max-image-pixels", type=positive_int, default=None,
                       help="largest image accepted, in pixels (default 40,000,000)")
    serve.add_argument("--max-video-bytes", type=byte_size, default=None,
                       help="largest encoded video accepted (default 20 MiB; video models only)")
    serve.add_argument("--max-video-frames", type=positive_int, default=None,
                       help="most frames sampled from one video at the model's fps (default 64)")
    serve.add_argument("--max-video-seconds", type=_positive_seconds, default=None,
                       help="longest video accepted, in seconds (default 600)")
    serve.add_argument("--max-video-frame-pixels", type=positive_int, default=None,
                       help="largest video frame accepted, in pixels (default 1920x1080 = 2,073,600)")

    chat = sub.add_parser("chat", help="answer one question about one or more images and exit")
    _model_args(chat)
    chat.add_argument("--image", action="append", default=[], type=Path, help="image file (repeatable)")
    chat.add_argument("--max-tokens", type=positive_int, default=None)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    _memory_args(chat)
    chat.add_argument("question")

    doctor = sub.add_parser("doctor", help="check the machine (and model) for what silently breaks VLM serving")
    doctor.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    doctor.add_argument("--device", default="auto")
    doctor.add_argument("--dtype", default="auto")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--max-batch-size", type=positive_int, default=None, help="as for serve (sizes the memory plan)")
    doctor.add_argument("--max-batched-tokens", type=positive_int, default=None, help="as for serve")
    _memory_args(doctor)

    sub.add_parser("eval-demo", help="held-out accuracy of a model on shape scenes (see --help)", add_help=False)
    sub.add_parser("train-demo", help="train the demo model (see --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The demo tools own their flags; hand the rest of the line straight to them.
    if argv and argv[0] == "eval-demo":
        from fovea.demo.evaluate import main as eval_main
        return eval_main(argv[1:])
    if argv and argv[0] == "train-demo":
        from fovea.demo.train import main as train_main
        train_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    who = f"pd-worker-{args.internal_pd_worker} " if getattr(args, "internal_pd_worker", None) is not None else ""
    from fovea.logs import configure

    os.environ["FOVEA_LOG_FORMAT"] = args.log_format  # PD workers and encode workers log the same way
    configure(args.log_level, args.log_format, who.strip() or None)
    try:
        if args.command == "serve":
            return serve(args, argv)
        if args.command == "chat":
            return chat(args)
        if args.command == "doctor":
            return doctor(args)
    except FoveaError as exc:
        print(f"fovea: error: {exc.message}", file=sys.stderr)
        return 2
    return 1


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    """One server, a front (``--pd-workers``: ``fovea.front``), or a PD worker behind a front."""
    import uvicorn

    from fovea.config import ServerSettings
    from fovea.media.config import MediaConfig
    from fovea.serve.http_protocol import uvicorn_options

    media_kwargs = {}
    if args.max_image_bytes is not None:
        media_kwargs["max_image_bytes"] = args.max_image_bytes
        # The upload store holds at least one image of the largest size accepted (as for videos).
        media_kwargs["store_max_bytes"] = max(MediaConfig().store_max_bytes, args.max_image_bytes)
    if args.max_image_pixels is not None:
        media_kwargs["max_image_pixels"] = args.max_image_pixels
    if args.decode_memory is not None:
        media_kwargs["large_decode_budget_bytes"] = args.decode_memory
    for name in ("max_video_bytes", "max_video_frames", "max_video_seconds", "max_video_frame_pixels"):
        if getattr(args, name) is not None:
            media_kwargs[name] = getattr(args, name)
    pd_worker = args.internal_pd_worker is not None
    api_key, encode_key = args.api_key, None
    if pd_worker:  # its port takes the front's key only; the front checks the clients' own
        from fovea.front.children import pd_worker_secrets

        api_key, encode_key = pd_worker_secrets()
    if args.engine != "paged":
        raise FoveaError(f"--engine {args.engine} was removed: fovea has one engine (paged), and transformers' own "
                         "forward is kept only as the reference tests and `fovea doctor` compare against; drop --engine")
    try:
        settings = ServerSettings(
            model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
            load_format=args.load_format,
            served_model_name=args.served_model_name, topology=args.topology, engine_core=args.engine_core,
            api_server_count=args.api_server_count,
            encode_workers=args.encode_workers, encode_timeout_s=args.encode_timeout,
            ray_address=None if pd_worker else args.ray_address,
            ray_pd_resources=None if pd_worker else args.ray_pd_resources,
            ray_encode_resources=None if pd_worker else args.ray_encode_resources,
            encode_device=args.encode_device,
            pd_workers=None if pd_worker else args.pd_workers,
            pd_timeout_s=None if pd_worker else args.pd_timeout,
            encode_addresses=tuple(args.internal_encode_socket), encode_authkey=encode_key,
            vision_batch_size=args.vision_batch_size,
            max_batch_size=args.max_batch_size,
            max_batched_tokens=args.max_batched_tokens, step_overlap=args.step_overlap,
            fused_vision=args.fused_vision, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
            preprocess_workers=args.preprocess_workers,
            max_queue=args.max_queue, limit_images_per_prompt=args.limit_images_per_prompt,
            max_body_bytes=args.max_body_bytes, api_key=api_key,
            processor_override=args.processor_override, force_processor_override=args.force_processor_override,
            canary=not args.no_canary, canary_interval_s=args.canary_interval, strict=args.strict,
            media=MediaConfig(
                allowed_media_dirs=tuple(args.allowed_media_dir),
                allowed_media_domains=tuple(args.allowed_media_domains),
                allow_private_addresses=args.allow_private_media_addresses,
                prereduce=not args.exact_image_resize,
                **media_kwargs,
            ),
        )
    except ValueError as exc:  # a combination of flags that cannot work: one line, no traceback
        raise FoveaError(str(exc)) from None
    from fovea.startup_clock import STARTUP

    if not pd_worker:  # its front checked these
        from fovea.serve.startup_checks import check_before_load

        with STARTUP.phase("checks before load"):
            check_before_load(settings, front=bool(settings.pd_workers))
    if settings.pd_workers:
        from fovea.front.app import run_front

        return run_front(settings, argv, args.log_level)
    with STARTUP.phase("imports"):
        from fovea.serve.app import create_app  # torch and the engine: not for a front

    if pd_worker:
        from fovea.disagg.parent_watch import exit_with_parent

        exit_with_parent()
    from fovea.gil import set_switch_interval

    set_switch_interval()  # the engine thread (here or in the core) and the loops hand the GIL over fast
    sockets, peers = None, None
    if settings.api_server_count > 1:  # more API processes on this port, all feeding the one engine core
        from fovea.serve.api_servers import ApiServers, port_socket, shared_metrics_dir
        from fovea.serve.metrics import share_between_processes

        # The port first: a port that is taken is refused before the model loads, and before a
        # further process (which binds it beside this one) could be mistaken for its holder.
        sockets = [port_socket(settings.host, settings.port, first=True)]
        metrics_dir = shared_metrics_dir()  # each process observes its own requests; /metrics shows the sums
        share_between_processes(str(metrics_dir))  # the further API processes inherit it
        peers = ApiServers(settings, args.log_level, args.log_format, metrics_dir)
    try:  # the further API processes start as soon as the core's process does, beside its load
        app = create_app(settings, on_core_address=peers.start if peers is not None else lambda address: None)
    except BaseException:
        if peers is not None:
            peers.stop()
        raise
    # log_config=None: keep fovea's handlers (fovea.logs), which carry the request ids.
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level=args.log_level.lower(), log_config=None, **uvicorn_options()))
    app.state.stop_server = lambda: setattr(server, "should_exit", True)  # a graceful stop (a dead engine core)
    if peers is not None:
        app.state.fovea.engine.before_stop.append(peers.stop)  # they stop (finishing their streams) first
    try:
        server.run(sockets=sockets)
        if not server.started:
            sys.exit(3)  # as uvicorn.run: the app could not start
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn stopped gracefully, then re-raised the SIGINT it caught, which Python
        # turns into a traceback. End by the signal instead, quietly, as after SIGTERM.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)
    except SystemExit:  # the app could not start: a refusal is printed in one line
        from fovea.serve.startup_checks import startup_refusal

        refusal = startup_refusal(app.state)
        if refusal is not None:
            raise refusal from None
        raise
    return getattr(app.state, "exit_code", 0)  # 1: stopped because its engine core died


def doctor(args: argparse.Namespace) -> int:
    from fovea.config import ServerSettings, engine_config
    from fovea.guard.checks import exit_code, render_json, render_text
    from fovea.guard.doctor import doctor_checks

    # The engine `fovea serve` would build with these flags.
    config = engine_config(ServerSettings(
        model=args.model, device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
        max_batched_tokens=args.max_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len))
    report: dict = {}
    checks = doctor_checks(args.model, args.device, args.dtype, engine_config=config, report=report)
    print(render_json(checks, report) if args.json else render_text(checks))
    return exit_code(checks)


def chat(args: argparse.Namespace) -> int:
    from fovea.config import ServerSettings, engine_config
    from fovea.engine import PagedEngine
    from fovea.engine.core.request import ErrorEvent, FinishEvent, default_max_tokens
    from fovea.engine.sampling.params import SamplingParams
    from fovea.loading.loader import load_model
    from fovea.loading.prompt import encode_prompt, render_chat
    from fovea.media import decode_image_bytes
    from fovea.media.config import MediaConfig

    loaded = load_model(args.model, args.device, args.dtype, load_format=args.load_format)
    media = MediaConfig()
    images = []
    for path in args.image:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise FoveaError(f"cannot read image {path}: {exc.strerror}") from exc
        images.append(decode_image_bytes(data, media))
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": args.question}]
    prompt = encode_prompt(loaded, render_chat(loaded, [{"role": "user", "content": content}]), images)

    async def run() -> str:
        engine = PagedEngine(loaded, engine_config(ServerSettings(
            model=args.model, device=args.device, dtype=args.dtype, max_batch_size=1,
            gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
            max_model_len=args.max_model_len)))
        # No --max-tokens: what the engine's per-sequence limit leaves after the prompt (as the server does).
        max_tokens = args.max_tokens or default_max_tokens(len(prompt.input_ids), engine.max_context)
        params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed)
        engine.start()
        try:
            async for event in engine.generate(prompt, params):
                if isinstance(event, FinishEvent):
                    return event.text
                if isinstance(event, ErrorEvent):
                    raise event.error
            return ""
        finally:
            engine.stop()

    print(asyncio.run(run()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
