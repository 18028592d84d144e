"""Plain tensor operations below every model and LoRA module: grouped matmul, fused-row layouts."""
