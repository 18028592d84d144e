"""A Tinker-compatible training service: clients' LoRA training and sampling calls (the
official ``tinker`` SDK pointed at ``base_url``) run on one multi-LoRA model, many clients'
calls batched into one step (``engine.py``), behind an HTTP front (``front.py`` checks and
queues each call, ``routes.py`` maps the SDK's endpoints onto it)."""
