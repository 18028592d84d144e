"""Multi-LoRA layers: N adapter slots in one wrapped linear, and their model-wide lifecycle."""
