"""One training step of every adapter slot and the forward-only passes beside it: micro-batch
preparation, megatron's schedule, gradient sync, per-slot optimizers, evaluation, generation."""
