"""Platform support: what megatron-core needs to run where CUDA is absent."""
