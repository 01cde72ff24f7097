"""A tiny random Qwen2.5-VL directory whose tokenizer can spell anything: byte-level BPE.

The random directories' word-level tokenizers have no ``{`` or ``"``, so no JSON answer can be
written with them. This one has the 256 byte tokens of GPT-2's byte-level alphabet (plus
two-letter filler tokens up to the architecture's word count, and Qwen's special tokens at the
same ids as ``random_qwen2_5_vl``), so structured outputs and tool calls can be tested on
random weights: the grammar makes every answer valid whatever the weights.

``TOOLS_TEMPLATE`` is Qwen2.5-Instruct's Hermes-style tool template (``<tools>`` in the system
turn, ``<tool_call>{...}</tool_call>`` answers, ``<tool_response>`` turns) with Qwen2.5-VL's
image and video parts. Qwen2.5-VL's own shipped template has no tools.

    python -m fovea.testing.byte_level_model --out DIR [--tools]
"""

from __future__ import annotations

import argparse
import itertools
import string
from pathlib import Path

from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from fovea.testing import random_qwen2_5_vl as qwen

TOOLS_TEMPLATE = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- elif content -%}"
    "{%- for part in content -%}{%- if part['type'] == 'image' or 'image' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'video' or 'video' in part -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- render(messages[0]['content']) }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + render(messages[0]['content']) + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + render(message.content) }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- render(message.content) }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


CLOSERS = '"}]'


def byte_level_vocab(size: int) -> dict[str, int]:
    """GPT-2's 256 byte characters, then two-letter fillers up to ``size`` tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # JSON's closers first: with equal logits, greedy picks the lowest allowed id, so a model
    # with its final norm zeroed closes every string, array and object at once (tests of JSON mode).
    byte_chars = sorted(alphabet, key=lambda c: (c not in CLOSERS, CLOSERS.find(c), ord(c) > 255, ord(c)))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for a, b in itertools.product(string.ascii_letters, repeat=2):
        if len(vocab) >= size:
            break
        vocab[a + b] = len(vocab)
    return vocab


def build_tokenizer(arch: qwen.Architecture) -> PreTrainedTokenizerFast:
    vocab = byte_level_vocab(arch.vocab_words)
    vocab.update(qwen.special_ids(arch))
    core = Tokenizer(BPE(vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        model_max_length=arch.max_positions)
    tokenizer.add_special_tokens({"additional_special_tokens": list(qwen.SPECIAL_IDS)})
    return tokenizer


def write_model_dir(out: Path, tools: bool = True, seed: int = 0, flat_logits: bool = False) -> Path:
    """A tiny random Qwen2.5-VL directory with the byte-level tokenizer (and with ``tools``, the
    tool template; else Qwen2.5-VL's own, which has none). ``flat_logits``: the final norm's
    weight is zero, so every logit is 0 and greedy picks the lowest allowed id (see CLOSERS)."""
    out = qwen.write_model_dir(Path(out), "tiny", seed=seed)
    if flat_logits:
        weights = out / "model-00001-of-00001.safetensors"
        tensors = load_file(str(weights))
        tensors["model.language_model.norm.weight"].zero_()
        save_file(tensors, str(weights), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).unlink(missing_ok=True)
    tokenizer = build_tokenizer(qwen.ARCHITECTURES["tiny"])
    tokenizer.chat_template = TOOLS_TEMPLATE if tools else qwen.CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(tokenizer.chat_template)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--no-tools", action="store_true", help="Qwen2.5-VL's own template (no tools)")
    args = parser.parse_args(argv)
    print(write_model_dir(args.out, tools=not args.no_tools))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
