"""One step on the device: the model runner (embeddings, chunked prefill and decode forward,
``model_runner``), decode steps as CUDA graphs (``cuda_graphs``), decode inputs still on the
device (``staging``: pending tokens) and the Triton kernels' start-up self-check
(``kernel_selfcheck``). The step inputs' pinned copies are ``fovea.engine.transfer``.
"""
