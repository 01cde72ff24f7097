"""Every Triton kernel of the engine, with its launch: paged decode and prefill attention
(``triton_decode``, ``triton_prefill``), the fused Llama ops (``triton_ops``), the fused vision
stages' elementwise steps (``vision_kernels``, ``qwen_vision_kernels``), the E->PD handoff's
checksum (``checksum_kernel``), the shared helpers (``triton_util``) and the case builders and
torch references the checks use (``cases``).

A kernel module imports no engine object: only torch, triton (lazily) and its neighbours here.
"""
