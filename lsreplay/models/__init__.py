"""Models and precision: loading a model folder (and converting the offline SmolLM2), the
policy as an HF model folder, the KV-cache keyword of the installed transformers, logits
to logprobs, and the trainable state (float32 masters, AdamW, learning-rate schedules)."""
