"""fovea's own forward of the language model on the paged KV cache: the Llama-style layers
(``llama``), the attention backends (``attention``: torch and Triton), the KV cache's shape and
tensors (``kv_cache``) and weights shared in place with transformers' modules (``weights``).
"""
