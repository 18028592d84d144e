"""What a run reports: metrics and progress, the adapter x task tables, plots, outcome."""
