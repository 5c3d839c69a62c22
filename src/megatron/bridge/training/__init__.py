"""Training-time configuration and schedules."""
