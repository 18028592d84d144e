"""Training multi-LoRA adapters: what a training run needs around the model."""
