"""Training data: a byte tokenizer, JSONL datasets, adapter-major packing and demo tasks."""
