"""Training objectives: a job's loss, its data and what it needs between steps
(``registry.objective_of`` builds one by name)."""
