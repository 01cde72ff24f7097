"""The vision stage: images in, embedding rows scattered into the prompt out.

``image_encoder`` (the batched vision worker) and ``encoder_cache`` (embeddings by pixel hash,
with ``vision_timings``), ``embeddings`` (a prompt's rows, image rows included, for prefill),
``vision_graphs`` (the eager stage as CUDA graphs), and the fused stages: ``vision_stage``
(which one a model gets), ``vision_fused`` (CLIP-style towers), ``qwen_vision_fused`` with
``qwen_vision_layout`` and ``varlen_attention`` (Qwen2.5-VL and Qwen3-VL towers). Their Triton
kernels are in ``fovea.engine.kernels``.
"""
