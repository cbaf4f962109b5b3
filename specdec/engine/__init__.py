"""The engine's core, with no model and no RPC: scheduler, block manager, KV cache,
sequences, sampling parameters, logits processing and the rejection sampler."""
