"""Serve mode: the run directory's mailbox (submissions, requests, journal, status; pure file
handling, no torch: the command line uses it) and the trainer's side of it."""
