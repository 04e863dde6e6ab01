"""Attention as each model family computes it, for replay's cascade attention (replay/cascade.py).

One file per way a family's attention differs from plain causal attention, each checked in
float64 by tests/test_attention_variants.py against the family's own attention and by the
family matrix (tests/test_families.py) through replay:

- kernels.py: the attention kernels (fused per device kind; plain torch ops, with softcapped
  logits, where no fused kernel does what a part needs);
- windows.py: sliding windows and chunks (which keys a layer's queries see);
- sinks.py: attention sinks (a logit in the softmax's normaliser with no value);
- latent.py: latent attention (cached latents, values narrower than keys).
"""
