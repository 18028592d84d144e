"""MoE slot routing: which adapter slot each dispatched expert row belongs to."""
