"""fovea: a server for vision-language models that never silently ignores the image."""

import os

# Models are local directories; nothing is ever fetched from a hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__version__ = "0.1.0"
