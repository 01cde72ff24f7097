"""fovea's own forward of the language model: weights shared in place with transformers'
modules (``weights``).
"""
