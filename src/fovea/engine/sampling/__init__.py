"""From logits to tokens: a request's sampling parameters and one-row sampling (``params``), the
batched on-device sampler (``sampler``) with its logit bias, stop tokens and penalties
(``logits_processors``), the logprobs a request asks for (``logprobs``) and prompt scoring from
the prefill (``prompt_scores``).
"""
