"""Train the fovea-shapes demo model from scratch (reproducible, resumable).

    python -m fovea.demo.train --out models/fovea-shapes          # on a GPU: a few minutes
    python -m fovea.demo.train --out runs/x --resume runs/x/ckpt  # carry on after a stop

The whole data pool is rendered up front on all CPU cores and moved to the device, so a
step is one gather plus one forward/backward (about 10 ms for the shipped size on an H200).
Held-out accuracy is the exact-match rate of greedy answers, measured with one teacher-
forced pass: greedy decoding reproduces an answer exactly when every answer token,
given the correct prefix, is the arg-max.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from fovea.demo import scenes
from fovea.demo.build import DemoArchitecture, build_model, save_model_dir
from fovea.demo.dataset import Pool, build_pool, gather_batch
from fovea.progress import progress

TRAIN_SEED, HELDOUT_SEED = 1, 2


@dataclass
class TrainConfig:
    out: str = "models/fovea-shapes"
    steps: int = 20_000
    batch_size: int = 256
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 500
    weight_decay: float = 0.05
    train_scenes: int = 300_000
    heldout_scenes: int = 4_000
    eval_every: int = 1_000
    checkpoint_every: int = 2_000
    target_accuracy: float = 0.995  # stop early once every task reaches this on held-out scenes
    time_budget_s: float = 0.0  # 0: no limit; else stop (and checkpoint) after this long
    seed: int = 0
    workers: int = 0
    device: str = "auto"
    compile: bool = True
    compile_mode: str = "default"  # torch.compile mode; "reduce-overhead" adds CUDA graphs
    resume: str = ""  # a checkpoint directory written by this script
    init_from: str = ""  # start from a model directory's weights with a fresh optimiser
    arch: DemoArchitecture = field(default_factory=DemoArchitecture)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@torch.no_grad()
def heldout_accuracy(model: torch.nn.Module, pool: Pool, mean: torch.Tensor, std: torch.Tensor,
                     batch_size: int = 512) -> dict[str, float]:
    """Exact-match accuracy per task (and for JPEG / non-square scenes) on every slot."""
    model.eval()
    n, k = pool.tokens.shape[:2]
    correct = torch.zeros(n, k, dtype=torch.bool, device=pool.tokens.device)
    for slot in range(k):
        for start in range(0, n, batch_size):
            idx = torch.arange(start, min(n, start + batch_size), device=pool.tokens.device)
            batch = gather_batch(pool, idx, torch.full_like(idx, slot), mean, std)
            with torch.autocast(pool.tokens.device.type, dtype=torch.bfloat16,
                                enabled=pool.tokens.device.type == "cuda"):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               pixel_values=batch["pixel_values"]).logits
            predicted = logits[:, :-1].argmax(-1)
            target = batch["labels"][:, 1:]
            ok = (predicted == target) | (target < 0)
            correct[idx, slot] = ok.all(dim=1)
    model.train()
    result: dict[str, float] = {}
    for t, task in enumerate(scenes.TASKS):
        result[task] = correct[:, pool.task == t].float().mean().item()
    result["jpeg"] = correct[pool.jpeg].float().mean().item()
    result["non_square"] = correct[~pool.square].float().mean().item()
    return result


def fit_schedule_to_budget(cfg: TrainConfig, step: int, started: float, step_times: list[float]) -> None:
    """Shorten the cosine schedule so that it ends inside the time budget.

    Reproduce such a run with ``--steps`` set to the step count it reports.
    """
    ms = sorted(step_times)[len(step_times) // 2] * 1.05
    left_s = cfg.time_budget_s - (time.time() - started) - 20.0
    fits = step + int(left_s * 1000 / ms)
    if fits < cfg.steps:
        log(f"time budget: {ms:.1f} ms/step leaves room for {fits} steps, not {cfg.steps}")
        cfg.steps = max(step + 1, fits)


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    step: int, cfg: TrainConfig) -> None:
    path.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "config": asdict(cfg),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    tmp = path / "state.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(path / "state.pt")  # never leave a half-written checkpoint behind


def train(cfg: TrainConfig) -> dict:
    started = time.time()
    device = pick_device(cfg.device)
    model, processor = build_model(cfg.arch, seed=cfg.seed)
    if cfg.init_from:
        model = LlavaForConditionalGeneration.from_pretrained(cfg.init_from, dtype=torch.float32)
        processor = LlavaProcessor.from_pretrained(cfg.init_from)
    model.to(device).train()
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters on {device}")

    t0 = time.time()
    train_pool = build_pool(processor, cfg.train_scenes, TRAIN_SEED, cfg.workers).to(device)
    heldout = build_pool(processor, cfg.heldout_scenes, HELDOUT_SEED, cfg.workers).to(device)
    log(f"data: {len(train_pool)} training and {len(heldout)} held-out scenes in {time.time() - t0:.1f} s")

    ip = processor.image_processor
    mean = torch.tensor(ip.image_mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(ip.image_std, device=device).view(1, 3, 1, 1)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8, fused=device.type == "cuda",
    )
    step = 0
    if cfg.resume and (Path(cfg.resume) / "state.pt").exists():
        state = torch.load(Path(cfg.resume) / "state.pt", map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        log(f"resumed from {cfg.resume} at step {step}")
    else:
        torch.manual_seed(cfg.seed)

    forward = torch.compile(model, mode=cfg.compile_mode) if (cfg.compile and device.type == "cuda") else model
    generator = torch.Generator(device=device).manual_seed(cfg.seed * 7919 + step)
    history: list[dict] = []
    best: dict[str, float] = {}
    step_times: list[float] = []
    last_mark = 0.0
    stop_reason = "steps"
    bar = progress(total=cfg.steps, initial=step, desc="train-demo", unit="step")
    while step < cfg.steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        scene_idx = torch.randint(len(train_pool), (cfg.batch_size,), device=device, generator=generator)
        slot_idx = torch.randint(train_pool.tokens.shape[1], (cfg.batch_size,), device=device, generator=generator)
        batch = gather_batch(train_pool, scene_idx, slot_idx, mean, std)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            try:
                loss = forward(**batch).loss
            except Exception as exc:  # a compiler failure must not cost the run
                if forward is model:
                    raise
                log(f"torch.compile failed ({type(exc).__name__}: {exc}); training eagerly")
                forward = model
                loss = forward(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        bar.update()
        if step % 100 == 0:
            loss_value = loss.item()  # syncs: only every 100 steps
            now = time.perf_counter()
            if last_mark:
                step_times.append((now - last_mark) * 10)  # ms per step over the last 100
            last_mark = now
            bar.set_postfix(loss=f"{loss_value:.4f}")
            if step == 400 and cfg.time_budget_s:
                fit_schedule_to_budget(cfg, step, started, step_times)
                bar.total = cfg.steps
            if step % 500 == 0:
                log(f"step {step} loss {loss_value:.4f} lr {lr_at(step, cfg):.2e}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            acc = heldout_accuracy(model, heldout, mean, std)
            history.append({"step": step, "elapsed_s": round(time.time() - started, 1), **acc})
            log(f"held-out @ {step}: " + " ".join(f"{k} {v:.4f}" for k, v in acc.items()))
            score = min(acc[t] for t in scenes.TASKS)
            if not best or score >= min(best[t] for t in scenes.TASKS):
                best = acc  # the shipped weights are those of the best evaluation so far
                save_model_dir(model, processor, Path(cfg.out))
            if all(acc[t] >= cfg.target_accuracy for t in scenes.TASKS):
                stop_reason = "target accuracy"
                break
        if cfg.resume and step % cfg.checkpoint_every == 0:
            save_checkpoint(Path(cfg.resume), model, optimizer, step, cfg)
        if cfg.time_budget_s and time.time() - started > cfg.time_budget_s:
            stop_reason = "time budget"
            break
    bar.close()
    if cfg.resume:
        save_checkpoint(Path(cfg.resume), model, optimizer, step, cfg)
    if not best:
        save_model_dir(model, processor, Path(cfg.out))
    steady = sorted(step_times[len(step_times) // 4:]) or [0.0]
    report = {
        "stopped_at_step": step,
        "stop_reason": stop_reason,
        "wall_time_s": round(time.time() - started, 1),
        "median_step_ms_sampled": round(steady[len(steady) // 2], 2),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "best_heldout": best,
        "history": history,
        "config": asdict(cfg),
    }
    (Path(cfg.out) / "training_report.json").write_text(json.dumps(report, indent=2))
    log(f"done: {stop_reason} at step {step} in {report['wall_time_s']} s; best held-out {best}")
    return report


def log(message: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    cfg = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in asdict(cfg).items():
        if name == "arch":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    args = parser.parse_args(argv)
    return TrainConfig(**{k: v for k, v in vars(args).items()})


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
