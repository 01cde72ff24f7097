"""One step on the device: the model runner (embeddings, chunked prefill and decode forward,
``model_runner``), decode steps as CUDA graphs (``cuda_graphs``), a step's small inputs copied
without stalling the host (``staging``) and the Triton kernels' start-up self-check
(``kernel_selfcheck``).
"""
