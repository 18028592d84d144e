"""Adapter jobs: the Job record, the board of slots they train in, their exports."""
