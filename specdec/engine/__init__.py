"""The verifier's engine (`engine.py`) and its parts: scheduler, block manager, KV cache,
sequences, sampling parameters, logits processing and the rejection sampler."""
