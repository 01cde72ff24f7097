"""Training and held-out data for the demo model: rendered scenes plus token sequences.

Images are drawn with ``scenes.render`` and resized exactly as the model's image processor
resizes them (PIL, bicubic, to the square input size), then kept as uint8 so a pool of
hundreds of thousands of scenes fits in GPU memory and a batch is a single gather there.
Prompts come from the real chat template and processor, so training sees byte for byte
the token ids that serving will build.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers import LlavaProcessor

from fovea.demo import scenes

SLOTS = ("describe", "count", "color", "where", "exists", "exists")
SLOT_TASK = np.array([scenes.TASKS.index(t) for t in SLOTS], dtype=np.int64)
IGNORE = -100


@dataclass
class Pool:
    images: torch.Tensor  # [N, 3, S, S] uint8
    tokens: torch.Tensor  # [N, K, L] int64, right-padded
    prompt_len: torch.Tensor  # [N, K] first answer position
    total_len: torch.Tensor  # [N, K] one past the end-of-sequence token
    task: torch.Tensor  # [K] task index of each slot
    jpeg: torch.Tensor  # [N] bool
    square: torch.Tensor  # [N] bool

    def to(self, device: torch.device | str) -> Pool:
        return Pool(*(t.to(device) for t in (self.images, self.tokens, self.prompt_len,
                                              self.total_len, self.task, self.jpeg, self.square)))

    def __len__(self) -> int:
        return self.images.shape[0]


def resize_like_processor(image: Image.Image, size: int) -> np.ndarray:
    """The image processor's resize (PIL bicubic to size x size), as CHW uint8."""
    resized = image.convert("RGB").resize((size, size), resample=Image.Resampling.BICUBIC)
    return np.asarray(resized, dtype=np.uint8).transpose(2, 0, 1).copy()


def encode_rendered(processor: LlavaProcessor, text: str, images: list[Image.Image]) -> list[int]:
    """Token ids of a prompt rendered by the chat template, with exactly one BOS, at the start.

    A template that writes the BOS itself (the demo's does) is tokenized with
    add_special_tokens=False, or the tokenizer's post-processor would add a second one; a
    template without it gets the post-processor's. This is the rule transformers'
    ``processor.apply_chat_template(..., tokenize=True)`` follows.
    """
    bos = processor.tokenizer.bos_token
    encoded = processor(text=text, images=images or None, add_special_tokens=not text.startswith(bos),
                        return_tensors="np")
    ids = encoded["input_ids"][0].tolist()
    bos_id = processor.tokenizer.bos_token_id
    if ids[:1] != [bos_id] or ids.count(bos_id) != 1:
        raise ValueError(f"the prompt {text[:60]!r}... tokenizes to {ids.count(bos_id)} BOS token(s), "
                         "not exactly one at the start")
    return ids


def prompt_table(processor: LlavaProcessor) -> dict[str, list[int]]:
    """Token ids of every training question, rendered through the chat template."""
    table: dict[str, list[int]] = {}
    blank = Image.new("RGB", (32, 32), "white")
    for question in scenes.all_question_texts():
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        table[question] = encode_rendered(processor, text, [blank])
    return table


def scene_rng(seed: int, index: int) -> random.Random:
    return random.Random(seed * 1_000_003 + index)


def slot_questions(scene: scenes.Scene, rng: random.Random) -> list[scenes.QA]:
    """The six question slots of one scene (a second 'where' stands in for a missing 'color')."""
    wheres = scenes.where_questions(scene)
    colours = scenes.color_questions(scene)
    return [
        scenes.describe(scene),
        scenes.count(scene),
        rng.choice(colours) if colours else rng.choice(wheres),
        rng.choice(wheres),
        scenes.exists_question(scene, rng, positive=True),
        scenes.exists_question(scene, rng, positive=False),
    ]


_WORKER: dict = {}


def _init_worker(tokenizer_json: str, prompts: dict[str, list[int]], eos: int, pad: int,
                 seq_len: int, size: int) -> None:
    from tokenizers import Tokenizer

    core = Tokenizer.from_str(tokenizer_json)
    core.no_padding()
    core.post_processor = None
    _WORKER.update(tok=core, prompts=prompts, eos=eos, pad=pad, seq_len=seq_len, size=size)


def _make_chunk(args: tuple[int, int, int]) -> tuple[np.ndarray, ...]:
    seed, start, count = args
    w = _WORKER
    k = len(SLOTS)
    images = np.empty((count, 3, w["size"], w["size"]), dtype=np.uint8)
    tokens = np.full((count, k, w["seq_len"]), w["pad"], dtype=np.int64)
    prompt_len = np.zeros((count, k), dtype=np.int64)
    total_len = np.zeros((count, k), dtype=np.int64)
    jpeg = np.zeros(count, dtype=bool)
    square = np.zeros(count, dtype=bool)
    sampler = scenes.SceneSampler()
    for row in range(count):
        rng = scene_rng(seed, start + row)
        scene = sampler.sample(rng)
        images[row] = resize_like_processor(scenes.render(scene), w["size"])
        jpeg[row] = scene.jpeg_quality is not None
        square[row] = scene.width == scene.height
        for slot, qa in enumerate(slot_questions(scene, rng)):
            prompt = w["prompts"][qa.question]
            answer = w["tok"].encode(qa.answer, add_special_tokens=False).ids + [w["eos"]]
            seq = prompt + answer
            if len(seq) > w["seq_len"]:
                raise ValueError(f"sequence of {len(seq)} tokens exceeds seq_len {w['seq_len']}")
            tokens[row, slot, : len(seq)] = seq
            prompt_len[row, slot] = len(prompt)
            total_len[row, slot] = len(seq)
    return images, tokens, prompt_len, total_len, jpeg, square


def max_sequence_length(prompts: dict[str, list[int]]) -> int:
    # The longest answer: three seven-word phrases, a comma, "and", then </s>.
    return max(len(p) for p in prompts.values()) + 3 * 7 + 2 + 1


def build_pool(processor: LlavaProcessor, n_scenes: int, seed: int, workers: int = 0,
               chunk: int = 500) -> Pool:
    """Render ``n_scenes`` scenes (seeded by index) with their six question slots each."""
    prompts = prompt_table(processor)
    tok = processor.tokenizer
    size = int(processor.image_processor.size["height"])
    seq_len = max_sequence_length(prompts)
    init_args = (tok.backend_tokenizer.to_str(), prompts, tok.eos_token_id, tok.pad_token_id, seq_len, size)
    jobs = [(seed, start, min(chunk, n_scenes - start)) for start in range(0, n_scenes, chunk)]
    workers = workers or max(1, (mp.cpu_count() or 1))
    if workers == 1 or len(jobs) == 1:
        _init_worker(*init_args)
        parts = [_make_chunk(job) for job in jobs]
    else:
        with mp.get_context("fork").Pool(workers, _init_worker, init_args) as pool:
            parts = pool.map(_make_chunk, jobs)
    cat = [np.concatenate([p[i] for p in parts]) for i in range(6)]
    return Pool(
        images=torch.from_numpy(cat[0]),
        tokens=torch.from_numpy(cat[1]),
        prompt_len=torch.from_numpy(cat[2]),
        total_len=torch.from_numpy(cat[3]),
        task=torch.from_numpy(SLOT_TASK.copy()),
        jpeg=torch.from_numpy(cat[4]),
        square=torch.from_numpy(cat[5]),
    )


def gather_batch(pool: Pool, scene_idx: torch.Tensor, slot_idx: torch.Tensor,
                 mean: torch.Tensor, std: torch.Tensor) -> dict[str, torch.Tensor]:
    """One training batch, built where the pool lives (normally the GPU)."""
    pixel_values = (pool.images[scene_idx].float() / 255.0 - mean) / std
    input_ids = pool.tokens[scene_idx, slot_idx]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    start = pool.prompt_len[scene_idx, slot_idx].unsqueeze(1)
    end = pool.total_len[scene_idx, slot_idx].unsqueeze(1)
    attention_mask = (positions < end).long()
    labels = torch.where((positions >= start) & (positions < end), input_ids, IGNORE)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "labels": labels,
    }
