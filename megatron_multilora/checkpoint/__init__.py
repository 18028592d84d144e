"""Checkpoints and adapter files: layout-independent adapter tensors, training state."""
