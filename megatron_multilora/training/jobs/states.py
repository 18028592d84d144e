"""The words a run uses for where its jobs and its trainer stand: in the job queue, in
``serve/status.json`` and in ``mmlora status``. No imports, so the command line reads them
without loading torch."""

# A job's status (training.jobs.job.Job.status).
QUEUED, ACTIVE, DONE, FAILED, CANCELLED = "queued", "active", "done", "failed", "cancelled"
ENDED = (DONE, FAILED, CANCELLED)

# The trainer's state in status.json (the training service's: serving, then stopped);
# RUNNING: it still looks at its mailbox.
TRAINING, IDLE, STOPPED, FINISHED, SERVING = "training", "idle", "stopped", "finished", "serving"
RUNNING = (TRAINING, IDLE, SERVING)
