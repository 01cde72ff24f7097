"""The engine's bookkeeping, with no device work: a request and its events (``request``), a
sequence's progress (``sequence``, with its incremental ``detokenize``), the step planner
(``scheduler``), the KV blocks and the prefix cache (``block_manager``) and the step whose
tokens are still on the device (``in_flight``).
"""
